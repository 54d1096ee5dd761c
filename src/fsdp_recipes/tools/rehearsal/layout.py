"""The user's Accelerate config, scaled down to a few CPU processes on one machine with its mesh's shape kept: each
dimension the real layout splits (replicas, FSDP shards, TP, EP, SP) is split 2 ways here, one it does not split is not.
Everything else (precision, wrap policy, resharding, state-dict type, activation checkpointing, efficient loading)
is the user's own; what cannot be kept on a CPU is changed and said."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from fsdp_recipes.common.errors import ConfigError

_PREFIX = "parallelism_config_"


@dataclasses.dataclass
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    sp: int = 1

    @property
    def processes(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.sp

    def describe(self) -> str:
        names = {"dp_replicate": "replicas", "dp_shard": "fsdp", "tp": "tp", "ep": "ep", "sp": "sp"}
        parts = [f"{names[name]} {size}" for name, size in dataclasses.asdict(self).items() if size > 1]
        return " x ".join(parts) or "one process"


def real_mesh(mapping: dict[str, Any]) -> Mesh:
    """The mesh the real config asks for (FSDP alone: every process one shard)."""
    sizes = mapping.get("parallelism_config") or {}
    processes = int(mapping.get("num_processes") or 1)
    mesh = Mesh(
        dp_replicate=int(sizes.get(f"{_PREFIX}dp_replicate_size") or 1),
        tp=int(sizes.get(f"{_PREFIX}tp_size") or 1),
        ep=int(sizes.get(f"{_PREFIX}ep_size") or 1),
        sp=int(sizes.get(f"{_PREFIX}sp_size") or 1),
    )
    shard = int(sizes.get(f"{_PREFIX}dp_shard_size") or 0)
    mesh.dp_shard = shard if shard > 0 else max(processes // (mesh.dp_replicate * mesh.tp * mesh.sp), 1)
    if mapping.get("distributed_type") not in ("FSDP", "MULTI_GPU") and processes <= 1:
        return Mesh()
    return mesh


def scaled_mesh(real: Mesh, processes: int | None) -> Mesh:
    """The real mesh with each split dimension 2 ways (the FSDP shards taking what `processes` leaves)."""
    scaled = Mesh(
        dp_replicate=2 if real.dp_replicate > 1 else 1,
        tp=2 if real.tp > 1 else 1,
        ep=2 if real.ep > 1 else 1,
        sp=2 if real.sp > 1 else 1,
    )
    fixed = scaled.dp_replicate * scaled.tp * scaled.sp
    if processes is None:
        scaled.dp_shard = 2 if real.dp_shard > 1 else 1
    elif processes % fixed:
        raise ConfigError(
            f"--processes {processes} cannot keep the shape of {real.describe()}: it must be a multiple of {fixed} "
            f"({scaled.describe()} before the FSDP shards)"
        )
    else:
        scaled.dp_shard = processes // fixed
    if scaled.ep > 1 and (scaled.dp_shard * scaled.tp) % scaled.ep:
        scaled.dp_shard = max(scaled.dp_shard, scaled.ep)
    return scaled


def scaled_config(mapping: dict[str, Any], processes: int | None) -> tuple[dict[str, Any], Mesh, Mesh, list[str]]:
    """(the scaled Accelerate config, the real mesh, the rehearsal's mesh, what was changed and why)."""
    real = real_mesh(mapping)
    mesh = scaled_mesh(real, processes)
    scaled, notes = dict(mapping), []
    scaled.update(
        num_machines=1, machine_rank=0, num_processes=mesh.processes, rdzv_backend="static", same_network=True
    )
    for key in ("main_process_ip", "main_process_port", "gpu_ids"):
        scaled.pop(key, None)
    if int(mapping.get("num_machines") or 1) > 1:
        notes.append(f"{mapping['num_machines']} machines -> one (the processes talk over gloo, not NCCL)")
    if mapping.get("parallelism_config"):
        sizes = dict(mapping["parallelism_config"])
        for name in ("dp_replicate", "dp_shard", "tp", "ep", "sp"):
            if f"{_PREFIX}{name}_size" in sizes:
                sizes[f"{_PREFIX}{name}_size"] = getattr(mesh, name)
        scaled["parallelism_config"] = sizes
    if mesh.processes > 1 and scaled.get("distributed_type") in (None, "NO"):
        scaled["distributed_type"] = "MULTI_GPU"
    fsdp = dict(scaled.get("fsdp_config") or {})
    if fsdp.get("fsdp_offload_params"):
        fsdp["fsdp_offload_params"] = False
        notes.append("fsdp_offload_params: true -> false (offloading to pinned CPU memory needs a GPU to offload from)")
    if fsdp:
        scaled["fsdp_config"] = fsdp
    if scaled.get("mixed_precision") == "fp8" and importlib.util.find_spec("torchao") is None:
        scaled["mixed_precision"] = "bf16"
        notes.append("mixed_precision fp8 -> bf16 (torchao is not installed here; the GPU run needs it too)")
    if scaled.get("mixed_precision") == "fp16":
        notes.append("mixed_precision fp16 runs on CPU without a loss scaler's overflow behaviour of a GPU")
    notes.append(f"mesh {real.describe()} ({real.processes} processes) -> {mesh.describe()} ({mesh.processes})")
    return scaled, real, mesh, notes
