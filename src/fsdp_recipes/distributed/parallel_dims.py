"""The layout of a launch, in one object: `ParallelDims`, the sizes of every parallel dimension and what follows from
them, built once and passed to whatever needs a size.

Built two ways, which agree (tests/test_parallel_dims.py checks every shipped config):
- offline, from an Accelerate config (`from_accelerate_config`): the linter, the estimator, `fsdp-recipes ls`,
  `rehearse` and the config generator;
- live, at start-up, from what `accelerate launch` exported (`from_environment`); the run's meshes are then attached
  once (`with_meshes`) and `Run.parallel` carries it to the losses, metrics, evaluation, checkpoints, generation and
  the router balance.

The dimensions are torchtitan's (`ParallelDims`) and accelerate's (`ParallelismConfig`, modelled on it), plus expert
parallelism. Accelerate's own class is not attached to the Accelerator for TP or SP: on the pinned accelerate 1.15
that switches on its TP preparation (which imports a class transformers 5 removed) or its DeepSpeed-only SP; the
meshes are attached by fsdp_recipes.distributed.tensor_parallel and .sequence_parallel instead.

Rank order: dp_replicate outermost, then dp_shard, then the dimensions that share one batch (tp or sp) innermost, so a
rank's data-parallel index is its rank over `batch_sharing_size`. Expert parallelism splits routed experts over `ep`
of the same ranks (ep divides dp_shard x tp) and changes no batch.

Context parallelism (`cp_size`) is read but refused (`context_parallel_problem`): torch's `context_parallel` has no
sharding rule for the CPU attention kernel, and rows are split by position with sequence parallelism instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed import expert_parallel

DOCS = "docs/parallelism.md"
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
DATA_PARALLEL_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")
EXPORTED = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # what accelerate's launcher exports (ep: expert_parallel)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes of a launch's parallel dimensions. DDP is `dp_replicate` alone; FSDP `dp_shard`; HSDP both."""

    dp_replicate: int = 1  # copies of the model (DDP, HSDP's replicas)
    dp_shard: int = 1  # ranks a copy is sharded over, with distinct batches (FSDP)
    tp: int = 1  # tensor parallelism: ranks splitting each layer, sharing one batch
    ep: int = 1  # expert parallelism: ranks splitting a layer's routed experts (within dp_shard x tp)
    sp: int = 1  # sequence parallelism: ranks splitting each row by position, sharing one batch (FSDP shards over them)
    cp: int = 1  # context parallelism: refused (context_parallel_problem)
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)  # the running launch's DeviceMesh
    sequence_shards: Any = dataclasses.field(default=None, compare=False, repr=False)  # this rank's SP group

    # --- what follows from the sizes: computed once, read as plain attributes ---------------------------------------
    world_size: int = dataclasses.field(init=False, repr=False)
    data_parallel_size: int = dataclasses.field(init=False, repr=False)  # ranks that each see a distinct batch
    # ranks that hold one batch together, and so the same values outside the model: a TP group or an SP group
    # (torchtitan's non-data-parallel size); 1 without either
    batch_sharing_size: int = dataclasses.field(init=False, repr=False)
    # ranks one parameter is split over by FSDP: dp_shard, times the sequence-parallel group (its ranks hold shards
    # of one model like any other); 1 under DDP
    shard_size: int = dataclasses.field(init=False, repr=False)
    fsdp_size: int = dataclasses.field(
        init=False, repr=False
    )  # ranks FSDP spans (replicas x shards): the world over tp
    hsdp_replicas: int | None = dataclasses.field(init=False, repr=False)  # copies of the model under HSDP, else None
    sharded_layers: bool = dataclasses.field(
        init=False, repr=False
    )  # TP or EP: transformers' N-D engine shards the layers

    def __post_init__(self):
        derived = {
            "data_parallel_size": self.dp_replicate * self.dp_shard,
            "batch_sharing_size": self.tp * self.sp * self.cp,
            "shard_size": self.dp_shard * self.sp * self.cp,
            "sharded_layers": self.tp > 1 or self.ep > 1,
        }
        derived["world_size"] = derived["data_parallel_size"] * derived["batch_sharing_size"]
        derived["fsdp_size"] = self.dp_replicate * derived["shard_size"]
        derived["hsdp_replicas"] = self.dp_replicate if self.dp_replicate > 1 and derived["shard_size"] > 1 else None
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def data_parallel_rank(self, process_index: int) -> int:
        """A rank's index among the data-parallel ranks (the dimensions sharing a batch are innermost)."""
        return process_index // self.batch_sharing_size

    def with_meshes(self, mesh: Any = None, sequence_shards: Any = None) -> ParallelDims:
        """The same sizes with the running launch's mesh (and SP group) attached, once, at start-up."""
        return dataclasses.replace(self, mesh=mesh, sequence_shards=sequence_shards)

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("dp_replicate", "dp_shard", "tp", "ep", "sp", "cp")}

    def describe(self) -> dict[str, Any]:
        """The run summary's record of the layout."""
        return {
            **self.sizes(),
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "batch_sharing_size": self.batch_sharing_size,
            "shard_size": self.shard_size,
            "hsdp_replicas": self.hsdp_replicas,
        }

    # --- offline: an Accelerate config ---------------------------------------------------------------------------------
    @classmethod
    def from_accelerate_config(cls, raw: Mapping, *, where: str = "the Accelerate config") -> ParallelDims:
        """The layout an Accelerate config's mapping asks `accelerate launch` for, read as the launcher reads it
        (num_processes is the global count). Raises ConfigError for sizes that cannot multiply to it and for
        context parallelism."""
        distributed = str(raw.get("distributed_type", "NO")).upper()
        world = int(raw.get("num_processes", 1) or 1)
        machines = int(raw.get("num_machines", 1) or 1)
        if world < 1:
            raise ConfigError(f"num_processes in {where} must be >= 1, got {world}")
        if distributed in DATA_PARALLEL_TYPES:
            return cls(dp_replicate=1 if distributed == "NO" else world)
        fsdp = {
            key if key.startswith("fsdp_") else f"fsdp_{key}": value
            for key, value in (raw.get("fsdp_config") or {}).items()
        }
        parallelism = {
            key.removeprefix("parallelism_config_"): value
            for key, value in (raw.get("parallelism_config") or {}).items()
        }
        sizes = {
            name: int(parallelism.get(f"{name}_size", 1) or 1) for name in ("dp_replicate", "tp", "ep", "sp", "cp")
        }
        if problem := context_parallel_problem(sizes["cp"], has_cuda=None):
            raise ConfigError(f"parallelism_config in {where}: {problem}")  # not a layout to estimate or list
        replicate, tp, ep, sp = sizes["dp_replicate"], sizes["tp"], sizes["ep"], sizes["sp"]
        if replicate > 1 or tp > 1 or ep > 1 or sp > 1:
            shard = int(parallelism.get("dp_shard_size", -1) or -1)
            shard = world // (replicate * tp * sp) if shard in (-1, 0) else shard
            if shard * replicate * tp * sp != world:
                raise ConfigError(
                    f"parallelism_config in {where}: dp_replicate_size {replicate} x dp_shard_size {shard} x "
                    f"tp_size {tp}" + (f" x sp_size {sp}" if sp > 1 else "") + f" != num_processes {world}"
                )
            return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, ep=ep, sp=sp)
        if int(fsdp.get("fsdp_version", 1)) != 2:  # the launcher exports FSDP1's strategy for any other version
            return cls.fsdp1(str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")), world, machines)
        return cls(dp_shard=world)

    @classmethod
    def fsdp1(cls, strategy: str, world: int, machines: int) -> ParallelDims:
        """FSDP1's fsdp_sharding_strategy as a layout: NO_SHARD replicates, the hybrid strategies shard within a
        machine and replicate across machines (the launcher exports the strategy; FSDP2 expresses HSDP with
        parallelism_config instead)."""
        strategy = strategy.upper()
        if strategy.isdigit():
            strategy = FSDP1_STRATEGIES[int(strategy) - 1]
        if strategy == "NO_SHARD":
            return cls(dp_replicate=world)
        if "HYBRID" in strategy:
            per_machine = max(1, world // machines)
            return cls(dp_replicate=world // per_machine, dp_shard=per_machine)
        return cls(dp_shard=world)

    # --- live: what the launcher exported ----------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ParallelDims:
        """The layout `accelerate launch` (or torchrun with the same variables) exported for this process: WORLD_SIZE,
        ACCELERATE_USE_FSDP / FSDP_VERSION / FSDP_SHARDING_STRATEGY and PARALLELISM_CONFIG_*_SIZE (EP's exported by
        fsdp_recipes.distributed.expert_parallel). Sizes that do not multiply to the world size are kept as asked, for
        the launch checks to name (fsdp_recipes.distributed.launch_checks)."""
        world = int(environ.get("WORLD_SIZE", "1") or 1)
        fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
            sizes = {name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or 1) for name in EXPORTED}
            ep = int(environ.get(expert_parallel.ENVIRONMENT, "1") or 1)
            replicate, tp, sp, cp = (max(1, sizes[name]) for name in ("dp_replicate", "tp", "sp", "cp"))
            shard = sizes["dp_shard"] if sizes["dp_shard"] > 0 else max(1, world // (replicate * tp * sp * cp))
            return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, ep=ep, sp=sp, cp=cp)
        if not fsdp:
            return cls(dp_replicate=world)
        if environ.get("FSDP_VERSION", "1") != "2":
            local = int(environ.get("LOCAL_WORLD_SIZE", world) or world)
            return cls.fsdp1(environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"), world, max(1, world // local))
        return cls(dp_shard=world)


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
