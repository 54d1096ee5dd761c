"""Dimensions past data parallelism in an Accelerate config's `parallelism_config` (tensor parallelism `tp_size`,
context parallelism `cp_size`): what a launch that asks for them may do, checked at start-up on every rank before any
weights load and by `fsdp-recipes validate-config`.

- TP runs through transformers' own N-D engine (fsdp_recipes.distributed.tensor_parallel), not accelerate's TP
  preparation, which on the pinned accelerate 1.15 imports a class transformers 5 removed (docs/parallelism.md); the
  Accelerate settings that route cannot honour are refused with the reason.
- CP: torch's `context_parallel` has no sharding rule for the CPU attention kernel, so it needs CUDA; and it is not
  wired: rows are split by position with sequence parallelism (`sequence_parallel`) instead (the seam is
  `context_parallel_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping

DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
DOCS = "docs/parallelism.md"


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
        "torch's context_parallel (ring attention) is not wired into these recipes, which split rows by position "
        "with sequence parallelism instead: set parallelism_config_sp_size (Ulysses, an all-to-all around attention; "
        f"{DOCS}#sequence-parallelism)"
    )
    if has_cuda is False:
        return (
            f"context parallelism needs CUDA: cp_size {cp_size} on a machine without GPUs, and torch's "
            "context_parallel has no sharding rule for the CPU attention kernel "
            f"(aten._scaled_dot_product_flash_attention_for_cpu); besides, {not_wired}. Set "
            "parallelism_config_cp_size: 1 to rehearse on CPU"
        )
    return f"context parallelism (cp_size {cp_size}) is not supported: {not_wired}. Set parallelism_config_cp_size: 1"


def problems(environ: Mapping[str, str], has_cuda: bool | None = None) -> dict[str, str]:
    """{Accelerate config key: why it cannot run} for context parallelism (the TP route's own refusals:
    fsdp_recipes.distributed.tensor_parallel.problems)."""
    cp = context_parallel_problem(sizes_from_environment(environ)["cp"], has_cuda=has_cuda)
    return {"parallelism_config.parallelism_config_cp_size": cp} if cp else {}
