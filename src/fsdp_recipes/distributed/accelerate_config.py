"""An Accelerate config, read once: `LaunchLayout` is what a config asks `accelerate launch` for (processes and
machines, data parallelism or FSDP and its version, sharding and resharding, HSDP, mixed precision, CPU offload,
activation checkpointing, wrap policy, state-dict type), read from a YAML file, a mapping or a running Accelerator.

The one reader of the format: the estimator (fsdp_recipes.tools.estimator), the linter (`fsdp-recipes
validate-config`), the catalog (`fsdp-recipes ls`) and the generator of the shipped configs (fsdp_recipes.tools.topology,
whose topologies.yaml entries each produce a LaunchLayout and write it as a file) all go through this module.
Omitted keys mean what they mean to `accelerate launch` (its defaults are not the plugin's: see
accelerate_configs/README.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed import parallel_dims, sequence_parallel, tensor_parallel

COMPUTE_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # bytes per element of the compute dtype
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
DATA_PARALLEL_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")
DEFAULT_MIN_NUM_PARAMS = 100_000_000  # the launcher's fsdp_min_num_params when omitted


class UnreadableAccelerateConfig(ConfigError):
    """An Accelerate config file that does not exist, is not YAML, or does not hold a mapping of settings."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"Accelerate config {self.path!r} {reason}")


def read_accelerate_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The settings an Accelerate config file holds, as plain YAML (accelerate's own loader would check nothing
    inside fsdp_config either). Raises UnreadableAccelerateConfig."""
    path = Path(path)
    if not path.is_file():
        raise UnreadableAccelerateConfig(path, "does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise UnreadableAccelerateConfig(path, f"cannot be read: {error}") from None
    except yaml.YAMLError as error:
        raise UnreadableAccelerateConfig(path, f"is not valid YAML: {error}") from None
    if raw is None:  # an empty file: every setting takes the launcher's default
        return {}
    if not isinstance(raw, dict):
        raise UnreadableAccelerateConfig(path, "is not a YAML mapping of Accelerate settings")
    return raw


def fsdp_settings(raw: dict) -> dict[str, Any]:
    """The `fsdp_config` block with every key under its `fsdp_` name: the launcher prefixes the keys that lack it,
    so `version: 2` means `fsdp_version: 2`."""
    return {
        key if key.startswith("fsdp_") else f"fsdp_{key}": value
        for key, value in (raw.get("fsdp_config") or {}).items()
    }


def wrap_class_names(value: Any) -> tuple[str, ...] | None:
    """`fsdp_transformer_layer_cls_to_wrap` ('LlamaDecoderLayer,Embedding') as class names; None when not set."""
    names = tuple(name.strip() for name in str(value).split(",") if name.strip()) if value else ()
    return names or None


def as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


@dataclass(frozen=True)
class LaunchLayout:
    """What an Accelerate config asks for: how many processes, how they share the model, in which precision."""

    world_size: int = 1  # num_processes: the GLOBAL count, over all machines
    num_machines: int = 1
    distributed_type: str = "FSDP"  # FSDP, MULTI_GPU (DDP), NO (one process)
    fsdp_version: int = 2
    reshard_after_forward: bool = True  # FULL_SHARD; False = SHARD_GRAD_OP
    shard_size: int = 1  # ranks one parameter is split over (world size, the HSDP shard size, or 1)
    cpu_offload: bool = False
    mixed_precision: str = "no"
    activation_checkpointing: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    wrap_classes: tuple[str, ...] | None = None  # None: the model's _no_split_modules
    min_num_params: int = DEFAULT_MIN_NUM_PARAMS
    prefetch: bool = True  # FSDP1's backward prefetch (FSDP2 always prefetches)
    state_dict_type: str = "SHARDED_STATE_DICT"
    tp_size: int = 1  # tensor parallelism: ranks splitting each layer (transformers' DistributedConfig route)
    ep_size: int = 1  # expert parallelism: ranks splitting a layer's routed experts (the same route; no batch change)
    sp_size: int = 1  # sequence parallelism: ranks splitting each row by position (one batch; FSDP shards over them)

    @classmethod
    def data_parallel(cls, world_size: int, num_machines: int = 1, mixed_precision: str = "no") -> LaunchLayout:
        """DDP over `world_size` processes, or one process (distributed_type NO) when there is one."""
        kind = "NO" if world_size == 1 else "MULTI_GPU"
        return cls(
            world_size=world_size,
            num_machines=num_machines,
            distributed_type=kind,
            shard_size=1,
            mixed_precision=mixed_precision,
            wrap_policy="NO_WRAP",
        )

    # --- what follows from it ---------------------------------------------------------------------------------------
    @property
    def is_fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.world_size // max(1, self.num_machines))

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each see a distinct batch: the world size over the tensor- and sequence-parallel sizes."""
        return self.world_size // (self.tp_size * self.sp_size)

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP spans (replicas x shards): the world size over the tensor-parallel size (a sequence-parallel
        group's ranks hold shards of one model like any other)."""
        return self.world_size // self.tp_size

    @property
    def hsdp_replicate(self) -> int | None:
        """Copies of the model under HSDP (FSDP's ranks / shard size); None when every rank shares one copy."""
        return self.fsdp_size // self.shard_size if self.is_fsdp and 1 < self.shard_size < self.fsdp_size else None

    @property
    def sharding(self) -> str:
        if not self.is_fsdp or self.shard_size == 1 and self.fsdp_size > 1:
            return "NO_SHARD"
        kind = "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"
        if self.shard_size < self.fsdp_size:
            return "HSDP" if self.reshard_after_forward else "HSDP_SHARD_GRAD_OP"
        return kind

    @property
    def fsdp1_strategy(self) -> str:
        """The layout as FSDP1's fsdp_sharding_strategy."""
        if self.shard_size == 1 and self.fsdp_size > 1:
            return "NO_SHARD"
        if self.shard_size < self.fsdp_size:
            return "HYBRID_SHARD" if self.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES.get(self.mixed_precision, 4)

    def describe(self) -> str:
        if self.distributed_type == "NO":
            return f"1 process, no data parallelism, {self.mixed_precision}"
        if self.distributed_type == "MULTI_GPU":
            return f"{self.world_size} processes, DDP (NO_SHARD), {self.mixed_precision}"
        parts = [f"{self.world_size} processes", f"FSDP{self.fsdp_version} {self.sharding}"]
        if self.shard_size < self.fsdp_size:
            parts[-1] += f" ({self.fsdp_size // self.shard_size} replicas x {self.shard_size} shards)"
        if self.tp_size > 1:
            parts[-1] += f" x TP {self.tp_size}"
        if self.ep_size > 1:
            parts[-1] += f" x EP {self.ep_size}"
        if self.sp_size > 1:
            parts[-1] += f" over SP {self.sp_size} (rows split by position)"
        parts.append(self.mixed_precision if self.mixed_precision != "no" else "fp32")
        if self.cpu_offload:
            parts.append("CPU offload")
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)

    # --- reading it -------------------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> LaunchLayout:
        """An Accelerate config file. Raises ConfigError."""
        return cls.from_mapping(read_accelerate_yaml(path), where=f"Accelerate config {str(path)!r}")

    @classmethod
    def from_mapping(cls, raw: dict, *, where: str = "the Accelerate config") -> LaunchLayout:
        """An Accelerate config as a mapping, read the way `accelerate launch` reads it. Raises ConfigError."""
        distributed = str(raw.get("distributed_type", "NO")).upper()
        world = int(raw.get("num_processes", 1) or 1)
        machines = int(raw.get("num_machines", 1) or 1)
        mixed = str(raw.get("mixed_precision", "no")).lower()
        if mixed not in COMPUTE_BYTES:
            raise ConfigError(f"mixed_precision {mixed!r} in {where} is not one of no, bf16, fp16, fp8")
        if world < 1:
            raise ConfigError(f"num_processes in {where} must be >= 1, got {world}")
        if distributed in DATA_PARALLEL_TYPES:
            return cls.data_parallel(1 if distributed == "NO" else world, machines, mixed)
        if distributed != "FSDP":
            raise ConfigError(f"distributed_type {distributed} in {where}: the estimator knows FSDP, MULTI_GPU and NO")
        fsdp = fsdp_settings(raw)
        version = int(fsdp.get("fsdp_version", 1))
        shard_size, reshard = world, True
        if version == 2:
            value = fsdp.get("fsdp_reshard_after_forward", True)
            strategies = {
                "FULL_SHARD": True,
                "HYBRID_SHARD": True,
                "SHARD_GRAD_OP": False,
                "_HYBRID_SHARD_ZERO2": False,
            }
            reshard = (
                strategies[str(value).upper()]
                if str(value).upper() in strategies
                else as_bool(value, "fsdp_reshard_after_forward")
            )
        else:  # the launcher always exports FSDP_SHARDING_STRATEGY from fsdp_sharding_strategy (default FULL_SHARD)
            strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
            if strategy.isdigit():
                strategy = FSDP1_STRATEGIES[int(strategy) - 1]
            reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")
            if strategy == "NO_SHARD":
                shard_size = 1
            elif "HYBRID" in strategy:
                shard_size = max(1, world // machines)
        parallelism = {
            k.removeprefix("parallelism_config_"): v for k, v in (raw.get("parallelism_config") or {}).items()
        }
        problem = parallel_dims.context_parallel_problem(int(parallelism.get("cp_size", 1) or 1), has_cuda=None)
        if problem:  # a layout that cannot run here is not one to estimate or list
            raise ConfigError(f"parallelism_config in {where}: {problem}")
        replicate = int(parallelism.get("dp_replicate_size", 1) or 1)
        tp = int(parallelism.get("tp_size", 1) or 1)
        ep = int(parallelism.get("ep_size", 1) or 1)
        sp = int(parallelism.get("sp_size", 1) or 1)
        if replicate > 1 or tp > 1 or ep > 1 or sp > 1:
            shard = int(parallelism.get("dp_shard_size", -1) or -1)
            shard = world // (replicate * tp * sp) if shard in (-1, 0) else shard
            if shard * replicate * tp * sp != world:
                raise ConfigError(
                    f"parallelism_config in {where}: dp_replicate_size {replicate} x dp_shard_size {shard} x "
                    f"tp_size {tp}" + (f" x sp_size {sp}" if sp > 1 else "") + f" != num_processes {world}"
                )
            shard_size = shard * sp  # FSDP shards over a sequence-parallel group's ranks too
        # FSDP1 saves full state dicts unless told otherwise, FSDP2 sharded ones (the plugin's defaults).
        state_dict_type = fsdp.get("fsdp_state_dict_type") or (
            "FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT"
        )
        return cls(
            world_size=world,
            num_machines=machines,
            distributed_type="FSDP",
            fsdp_version=version,
            reshard_after_forward=reshard,
            shard_size=shard_size,
            cpu_offload=as_bool(fsdp.get("fsdp_offload_params", False), "fsdp_offload_params"),
            mixed_precision=mixed,
            activation_checkpointing=as_bool(
                fsdp.get("fsdp_activation_checkpointing", False), "fsdp_activation_checkpointing"
            ),
            wrap_policy=str(
                fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")
            ).upper(),  # the launcher's default when omitted
            wrap_classes=wrap_class_names(fsdp.get("fsdp_transformer_layer_cls_to_wrap")),
            min_num_params=int(float(fsdp.get("fsdp_min_num_params", DEFAULT_MIN_NUM_PARAMS))),
            prefetch=version == 2 or str(fsdp.get("fsdp_backward_prefetch", "BACKWARD_PRE")).upper() != "NO_PREFETCH",
            state_dict_type=str(state_dict_type).upper(),
            tp_size=tp,
            ep_size=ep,
            sp_size=sp,
        )

    @classmethod
    def from_accelerator(cls, accelerator) -> LaunchLayout:
        """The layout of a running launch, from accelerate's resolved state (no collectives)."""
        distributed = accelerator.distributed_type.value
        world = accelerator.num_processes
        machines = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world) or world))
        mixed = str(accelerator.mixed_precision)
        if distributed != "FSDP":
            return cls.from_mapping(
                {
                    "distributed_type": "MULTI_GPU" if world > 1 else "NO",
                    "num_processes": world,
                    "num_machines": machines,
                    "mixed_precision": mixed,
                }
            )
        plugin = accelerator.state.fsdp_plugin
        policy = plugin.auto_wrap_policy
        policy = getattr(policy, "func", policy)
        name = policy if isinstance(policy, str) else getattr(policy, "__name__", "")
        wrap = (
            "TRANSFORMER_BASED_WRAP"
            if "transformer" in str(name).lower()
            else "SIZE_BASED_WRAP"
            if "size" in str(name).lower()
            else "NO_WRAP"
        )
        fsdp: dict[str, Any] = {
            "fsdp_version": plugin.fsdp_version,
            "fsdp_offload_params": type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
            or bool(getattr(plugin.cpu_offload, "offload_params", False)),
            "fsdp_activation_checkpointing": bool(plugin.activation_checkpointing),
            "fsdp_auto_wrap_policy": wrap,
            "fsdp_min_num_params": plugin.min_num_params or DEFAULT_MIN_NUM_PARAMS,
            "fsdp_state_dict_type": getattr(plugin.state_dict_type, "name", plugin.state_dict_type),
        }
        if plugin.transformer_cls_names_to_wrap:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(plugin.transformer_cls_names_to_wrap)
        if plugin.fsdp_version == 2:
            fsdp["fsdp_reshard_after_forward"] = bool(plugin.reshard_after_forward)
        else:
            fsdp["fsdp_sharding_strategy"] = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
        raw = {
            "distributed_type": "FSDP",
            "num_processes": world,
            "num_machines": machines,
            "mixed_precision": mixed,
            "fsdp_config": fsdp,
        }
        parallelism = getattr(accelerator, "parallelism_config", None)
        tensor_parallel_layout = tensor_parallel.layout_of(accelerator)
        if tensor_parallel_layout is not None:  # the TP route attaches a mesh, not a ParallelismConfig
            raw["parallelism_config"] = {
                "dp_replicate_size": tensor_parallel_layout.dp_replicate,
                "dp_shard_size": tensor_parallel_layout.dp_shard,
                "tp_size": tensor_parallel_layout.tp,
                "ep_size": tensor_parallel_layout.ep,
            }
        elif (sp := sequence_parallel.size_of(accelerator)) > 1:  # attached with FSDP's shard size (x sp)
            raw["parallelism_config"] = {
                "dp_replicate_size": parallelism.dp_replicate_size,
                "dp_shard_size": parallelism.dp_shard_size // sp,
                "sp_size": sp,
            }
        elif parallelism is not None and getattr(parallelism, "dp_replicate_size", 1) > 1:
            raw["parallelism_config"] = {
                "dp_replicate_size": parallelism.dp_replicate_size,
                "dp_shard_size": parallelism.dp_shard_size,
            }
        return cls.from_mapping(raw, where="the running launch")
