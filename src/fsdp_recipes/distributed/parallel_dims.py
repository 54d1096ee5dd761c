"""Dimensions past data parallelism in an Accelerate config's `parallelism_config` (tensor parallelism `tp_size`,
context parallelism `cp_size`), and why a launch that asks for them is refused on the pinned versions.

Accelerate describes an N-D mesh with `ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size, cp_size)`.
The data-parallel dimensions (FSDP, HSDP) run here. Tensor and context parallelism do not, for reasons found by
running them (docs/parallelism.md, benchmarks/tensor_parallel_probe.py) rather than assumed, so a launch asking for
either stops at start-up, on every rank, before any weights load, instead of training something other than what the
config says:

- TP with FSDP2 (accelerate 1.15, transformers 5.24 here and 5.17 on the GPU machine): `Accelerator.prepare` imports
  `transformers.integrations.tensor_parallel.ReplicateParallel`, which transformers 5.x no longer has, as soon as the
  model holds a DTensor parameter; and transformers 5.24's `from_pretrained(tp_plan="auto", device_mesh=mesh["tp"])`
  ignores the mesh and shards over every process (tp_size defaults to WORLD_SIZE), so on a 2 x 2 mesh the model comes
  up TP 4. TP without FSDP on CPU: accelerate refuses a ParallelismConfig under MULTI_CPU.
- CP: torch's `context_parallel` has no sharding rule for the CPU attention kernel, so it needs CUDA; and the recipes
  do not yet shard batches along the sequence (the seam is `context_parallel_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping

DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
DOCS = "docs/parallelism.md"

TENSOR_PARALLEL_BLOCKED = (
    "tensor parallelism does not run with the pinned accelerate 1.15 and transformers 5.x: accelerate's prepare under "
    "FSDP2 imports transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5.x removed, and "
    "transformers 5.24's from_pretrained(tp_plan='auto') shards over all processes instead of the mesh's tp dimension "
    f"({DOCS}). Set parallelism_config_tp_size: 1 and shard with FSDP alone (HSDP across nodes: "
    "accelerate_configs/hsdp_2x8gpu.yaml)"
)


def sizes_from_environment(environ: Mapping[str, str]) -> dict[str, int]:
    """The parallelism_config sizes `accelerate launch` exported (PARALLELISM_CONFIG_*_SIZE), 1 where absent."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return dict.fromkeys(DIMENSIONS, 1)
    return {name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or 1) for name in DIMENSIONS}


def context_parallel_problem(cp_size: int, *, has_cuda: bool | None) -> str | None:
    """Why cp_size cannot run here; None for cp_size 1. `has_cuda` None: the machine is not known (a config checked
    offline). The seam for context parallelism: once the recipes shard each batch along the sequence (accelerate's
    `maybe_context_parallel` over input ids, labels and positions; loss over the dp x cp group), only the CUDA
    condition stays."""
    if cp_size <= 1:
        return None
    not_wired = (
        "these recipes do not shard batches along the sequence yet (the model would see whole sequences on every "
        f"cp rank; {DOCS})"
    )
    if has_cuda is False:
        return (
            f"context parallelism needs CUDA: cp_size {cp_size} on a machine without GPUs, and torch's "
            "context_parallel has no sharding rule for the CPU attention kernel "
            f"(aten._scaled_dot_product_flash_attention_for_cpu); besides, {not_wired}. Set "
            "parallelism_config_cp_size: 1 to rehearse on CPU"
        )
    return f"context parallelism (cp_size {cp_size}) is not supported: {not_wired}. Set parallelism_config_cp_size: 1"


def tensor_parallel_problem(tp_size: int) -> str | None:
    """Why tp_size cannot run with the pinned versions; None for tp_size 1."""
    return None if tp_size <= 1 else f"tp_size {tp_size}: {TENSOR_PARALLEL_BLOCKED}"


def problems(environ: Mapping[str, str], has_cuda: bool | None = None) -> dict[str, str]:
    """{Accelerate config key: why it cannot run} for the dimensions the launch environment asks for."""
    sizes = sizes_from_environment(environ)
    found = {"tp": tensor_parallel_problem(sizes["tp"]), "cp": context_parallel_problem(sizes["cp"], has_cuda=has_cuda)}
    return {f"parallelism_config.parallelism_config_{name}_size": problem for name, problem in found.items() if problem}
