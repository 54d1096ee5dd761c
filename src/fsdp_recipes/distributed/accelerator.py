"""Building the Accelerator from what `accelerate launch` exported, including real FSDP2 on CPU.

On a GPU machine this is plain `Accelerator()`: accelerate reads the FSDP_* environment that the launcher wrote from
the Accelerate YAML.

On a machine with no accelerator device, accelerate will not do FSDP: under `accelerate launch` each process would
silently become its own "rank 0" and train alone. PyTorch's FSDP2 itself runs fine on CPU with gloo, so for FSDP2
launches we let accelerate form a real gloo group (`cpu=True`) and then switch its state to FSDP, so that
`accelerator.prepare` shards the model with accelerate's own FSDP2 code, exactly as on GPUs. This relies on two private
attributes of accelerate's state objects (checked on accelerate 1.15); `_switch_state_to_fsdp` verifies the switch
took and fails loudly otherwise, and tests/test_distributed.py runs it under real processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, TypeVar

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType, gather_object

from fsdp_recipes.common.errors import DistributedSetupError
from fsdp_recipes.distributed import buffer_loading, expert_parallel, float8, sequence_parallel, tensor_parallel
from fsdp_recipes.distributed.parallel_dims import ParallelDims

T = TypeVar("T")


def launched_world_size() -> int:
    """Number of processes the launcher started (torchrun's WORLD_SIZE), whatever accelerate made of it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def has_accelerator_device() -> bool:
    return torch.accelerator.is_available()


def build_accelerator(
    parallel: ParallelDims | None = None, **accelerator_kwargs: Any
) -> tuple[Accelerator, ParallelDims]:
    """The Accelerator for this launch (real FSDP on GPUs, real FSDP2 over gloo on CPU, and never a degraded launch),
    and `parallel` (default: what the launcher exported, `ParallelDims.from_environment`) with the meshes it
    attached.

    Keyword arguments go to `Accelerator` (mixed precision, FSDP settings and the like come from the launcher's
    environment, i.e. from the Accelerate YAML, and should not be passed here).
    """
    if parallel is None:
        expert_parallel.export_launched_size()  # the one size accelerate's launcher does not export
        parallel = ParallelDims.from_environment(os.environ)
    mesh = shards = None
    if parallel.sharded_layers or parallel.sp > 1:
        # TP/EP: transformers shards the model itself; accelerate must not build its own TP ParallelismConfig (whose
        # preparation is broken on the pinned versions). SP: accelerate 1.15 runs parallelism_config_sp_size only with
        # DeepSpeed. Either way its parallelism config is hidden and the mesh attached here.
        with _environment_without("ACCELERATE_USE_PARALLELISM_CONFIG"):
            if has_accelerator_device():
                accelerator = Accelerator(**accelerator_kwargs)
            else:
                accelerator = _build_cpu_fsdp2_accelerator(**accelerator_kwargs)
        if parallel.sharded_layers:
            mesh = tensor_parallel.attach_data_parallel_mesh(accelerator, parallel)
        else:
            mesh, shards = sequence_parallel.attach(accelerator, parallel)  # distributed/sequence_parallel.py
    elif fsdp_requested() and not has_accelerator_device():
        accelerator = _build_cpu_fsdp2_accelerator(**accelerator_kwargs)
    elif launched_world_size() > 1 and not has_accelerator_device():
        # A DDP (MULTI_GPU, i.e. NO_SHARD) launch rehearsed on CPU: accelerate's MULTI_CPU joins the processes over
        # gloo; plain Accelerator() would leave each process training alone.
        accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    else:
        accelerator = Accelerator(**accelerator_kwargs)
    refuse_degraded_launch(accelerator)
    keep_fp32_module_outputs(accelerator)
    buffer_loading.install()  # checkpoint buffers (DeepSeek-V3's router bias) through accelerate's FSDP2 load
    return accelerator, parallel.with_meshes(mesh or accelerator.torch_device_mesh, shards)


def keep_fp32_module_outputs(accelerator: Accelerator) -> None:
    """Under FSDP2 mixed precision accelerate asks every sharded module to cast its floating outputs to the compute
    dtype (`MixedPrecisionPolicy.output_dtype`). Layers computing in bf16 return bf16 anyway; what the cast changes
    is the outputs deliberately kept in fp32: the chunked loss's per-token losses, which the output layer returns,
    would be rounded to bf16 (8 bits of mantissa) before any sum or log-ratio. torchtitan leaves output_dtype unset,
    as this does; parameters still gather in the compute dtype and gradients still reduce in reduce_dtype."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if accelerator.distributed_type != DistributedType.FSDP or plugin.fsdp_version != 2 or policy is None:
        return
    if getattr(policy, "output_dtype", None) is not None:
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def _build_cpu_fsdp2_accelerator(**accelerator_kwargs: Any) -> Accelerator:
    if os.environ.get("FSDP_VERSION", "1") != "2":  # checked first: building an FSDP1 plugin needs a device
        raise DistributedSetupError(
            "FSDP1 cannot run on CPU (PyTorch's FSDP1 needs an accelerator device). To rehearse on CPU, use an "
            "Accelerate config with `fsdp_version: 2`; FSDP1 configs run on GPU machines only."
        )
    plugin = FullyShardedDataParallelPlugin()  # reads the launcher's FSDP_* environment
    _offload_without_pinned_memory(plugin)
    # Accelerator() would build the HSDP ParallelismConfig from the environment and reject it for MULTI_CPU, so it is
    # hidden here and attached after the switch to FSDP (_attach_cpu_hsdp_mesh).
    hsdp_requested = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    with _environment_without("ACCELERATE_USE_PARALLELISM_CONFIG"):
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, **accelerator_kwargs)
    if not torch.distributed.is_initialized():
        # Started without a launcher (plain `python`): no process group to shard over; train unsharded.
        return accelerator
    # Even a 1-process launch goes through FSDP2: its checkpoints then have the same layout as those of N processes,
    # and any of them can resume the other's.
    _switch_state_to_fsdp(accelerator, plugin)
    if hsdp_requested:
        _attach_cpu_hsdp_mesh(accelerator)
    return accelerator


def _offload_without_pinned_memory(plugin: FullyShardedDataParallelPlugin) -> None:
    """CPU offload rehearsed on CPU: FSDP2's offload policy pins the host copies, which needs an accelerator; without
    pinning, the offload code path (parameters and gradients kept on the host, the step run there) is the same."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


@contextlib.contextmanager
def _environment_without(name: str):
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def _attach_cpu_hsdp_mesh(accelerator: Accelerator) -> None:
    """HSDP on CPU: the YAML's `parallelism_config` (PARALLELISM_CONFIG_* in the environment) becomes a
    (dp_replicate, dp_shard) device mesh on "cpu", attached where accelerate's FSDP2 preparation looks for it."""
    from accelerate.parallelism_config import ParallelismConfig

    parallelism = ParallelismConfig()  # reads the launcher's PARALLELISM_CONFIG_* environment
    try:
        parallelism._validate_accelerator(accelerator)  # the sizes must multiply to the number of processes
    except ValueError as error:
        raise DistributedSetupError(
            f"the Accelerate config's parallelism_config does not fit this launch ({error}). Make "
            "parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size equal --num_processes."
        ) from None
    accelerator.state.parallelism_config = parallelism
    accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
    if accelerator.parallelism_config is not parallelism or accelerator.torch_device_mesh is None:
        raise DistributedSetupError(
            "could not attach the HSDP device mesh on CPU: accelerate's internals changed (this was written for "
            f"accelerate 1.15; installed: {_accelerate_version()}). Pin accelerate==1.15.0 or update "
            "fsdp_recipes/distributed.py."
        )


def _switch_state_to_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    # Both shared-state objects must say FSDP: AcceleratorState copies PartialState's value back on re-creation.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    if not (accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2):
        raise DistributedSetupError(
            "could not switch accelerate to FSDP2 on CPU: accelerate's internals changed (this was written for "
            f"accelerate 1.15; installed: {_accelerate_version()}). Pin accelerate==1.15.0 or update "
            "fsdp_recipes/distributed.py."
        )


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def refuse_degraded_launch(accelerator: Accelerator) -> None:
    """Fail if the launcher started several processes but accelerate did not join them into one group: each would
    then train alone and they would all write to the same output_dir."""
    world_size = launched_world_size()
    if world_size > 1 and accelerator.num_processes != world_size:
        refused = DistributedSetupError(
            f"the launcher started {world_size} processes but accelerate joined {accelerator.num_processes} "
            f"(distributed type {accelerator.distributed_type.value}): every process would train alone. This happens "
            "when the Accelerate config asks for a GPU setup on a machine without GPUs. Use an FSDP2 config "
            "(fsdp_version: 2), which also runs on CPU, or launch on a machine with accelerators."
        )
        refused.reported_by_main_rank = False  # the processes share no group: each says it, none waits on another
        raise refused


def local_and_total_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model). Under FSDP2 parameters are DTensors whose local
    shard is what the rank stores."""
    local = total = 0
    for param in model.parameters():
        total += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local, total


def describe_run(
    accelerator: Accelerator, parallel: ParallelDims, model: torch.nn.Module, wrap_classes: list[str] | None
) -> dict[str, Any]:
    """Collective: what this launch really does (from accelerate's resolved state, not from the YAML text)."""
    local, total = local_and_total_parameters(model)
    per_rank = gather_object([local]) if accelerator.num_processes > 1 else [local]
    summary: dict[str, Any] = {
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        **({"float8_linear_layers": float8.converted_layers(model)} if accelerator.mixed_precision == "fp8" else {}),
        "parameters_total": total,
        "parameters_per_rank": per_rank,
        "parameter_placements": sorted({str(getattr(p, "placements", "unsharded")) for p in model.parameters()}),
        # which meshes hold them: ("efsdp", "ep") for experts split by expert parallelism
        "parameter_meshes": sorted(
            {str(p.device_mesh.mesh_dim_names) for p in model.parameters() if hasattr(p, "device_mesh")}
        ),
        "fsdp": None,
        "parallel_dims": parallel.describe(),
        "tensor_parallel": tensor_parallel.describe(parallel),
        "sequence_parallel": sequence_parallel.describe(parallel),
    }
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        summary["fsdp"] = {
            "version": plugin.fsdp_version,
            "reshard_after_forward" if plugin.fsdp_version == 2 else "sharding_strategy": str(
                plugin.reshard_after_forward if plugin.fsdp_version == 2 else plugin.sharding_strategy
            ),
            "wrap_classes": wrap_classes,
            "cpu_offload": _offloads_parameters(plugin),
            "state_dict_type": getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type)),
            "activation_checkpointing": bool(plugin.activation_checkpointing),
        }
    return summary


def _offloads_parameters(plugin: FullyShardedDataParallelPlugin) -> bool:
    # FSDP2 holds an OffloadPolicy (no offload) or a CPUOffloadPolicy; FSDP1 a CPUOffload with a flag.
    policy = plugin.cpu_offload
    return type(policy).__name__ == "CPUOffloadPolicy" or bool(getattr(policy, "offload_params", False))


def launch_environment() -> dict[str, str]:
    """The Accelerate/FSDP settings the launcher exported: the Accelerate config as this run received it."""
    prefixes = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
    return {key: value for key, value in sorted(os.environ.items()) if key.startswith(prefixes)}
