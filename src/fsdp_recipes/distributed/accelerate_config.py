"""An Accelerate config, read once: `LaunchLayout` is what a config asks `accelerate launch` for (processes and
machines, data parallelism or FSDP and its version, sharding and resharding, HSDP, mixed precision, CPU offload,
activation checkpointing, wrap policy, state-dict type), read from a YAML file, a mapping or a running Accelerator.
Its sizes (processes, replicas, shards, tp, ep, sp) are one `ParallelDims` (fsdp_recipes.distributed.parallel_dims),
`LaunchLayout.parallel`, read by `ParallelDims.from_accelerate_config`; the rest is read here.

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
from fsdp_recipes.distributed.parallel_dims import DATA_PARALLEL_TYPES, FSDP1_STRATEGIES, ParallelDims

COMPUTE_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # bytes per element of the compute dtype
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
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

    parallel: ParallelDims = ParallelDims()  # the sizes: world (num_processes, the GLOBAL count), shards, tp, ep, sp
    num_machines: int = 1
    distributed_type: str = "FSDP"  # FSDP, MULTI_GPU (DDP), NO (one process)
    fsdp_version: int = 2
    reshard_after_forward: bool = True  # FULL_SHARD; False = SHARD_GRAD_OP
    cpu_offload: bool = False
    mixed_precision: str = "no"
    activation_checkpointing: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    wrap_classes: tuple[str, ...] | None = None  # None: the model's _no_split_modules
    min_num_params: int = DEFAULT_MIN_NUM_PARAMS
    prefetch: bool = True  # FSDP1's backward prefetch (FSDP2 always prefetches)
    state_dict_type: str = "SHARDED_STATE_DICT"

    @classmethod
    def data_parallel(
        cls, world_size: int, num_machines: int = 1, mixed_precision: str = "no", parallel: ParallelDims | None = None
    ) -> LaunchLayout:
        """DDP over `world_size` processes, or one process (distributed_type NO) when there is one."""
        kind = "NO" if world_size == 1 else "MULTI_GPU"
        return cls(
            parallel=ParallelDims(dp_replicate=world_size) if parallel is None else parallel,
            num_machines=num_machines,
            distributed_type=kind,
            mixed_precision=mixed_precision,
            wrap_policy="NO_WRAP",
        )

    # --- what follows from it ---------------------------------------------------------------------------------------
    @property
    def is_fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.parallel.world_size // max(1, self.num_machines))

    @property
    def sharding(self) -> str:
        shards, fsdp = self.parallel.shard_size, self.parallel.fsdp_size
        if not self.is_fsdp or shards == 1 and fsdp > 1:
            return "NO_SHARD"
        kind = "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"
        if shards < fsdp:
            return "HSDP" if self.reshard_after_forward else "HSDP_SHARD_GRAD_OP"
        return kind

    @property
    def fsdp1_strategy(self) -> str:
        """The layout as FSDP1's fsdp_sharding_strategy."""
        shards, fsdp = self.parallel.shard_size, self.parallel.fsdp_size
        if shards == 1 and fsdp > 1:
            return "NO_SHARD"
        if shards < fsdp:
            return "HYBRID_SHARD" if self.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES.get(self.mixed_precision, 4)

    def describe(self) -> str:
        p = self.parallel
        if self.distributed_type == "NO":
            return f"1 process, no data parallelism, {self.mixed_precision}"
        if self.distributed_type == "MULTI_GPU":
            return f"{p.world_size} processes, DDP (NO_SHARD), {self.mixed_precision}"
        parts = [f"{p.world_size} processes", f"FSDP{self.fsdp_version} {self.sharding}"]
        if p.shard_size < p.fsdp_size:
            parts[-1] += f" ({p.fsdp_size // p.shard_size} replicas x {p.shard_size} shards)"
        if p.tp > 1:
            parts[-1] += f" x TP {p.tp}"
        if p.ep > 1:
            parts[-1] += f" x EP {p.ep}"
        if p.sp > 1:
            parts[-1] += f" over SP {p.sp} (rows split by position)"
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
    def from_mapping(
        cls, raw: dict, *, where: str = "the Accelerate config", parallel: ParallelDims | None = None
    ) -> LaunchLayout:
        """An Accelerate config as a mapping, read the way `accelerate launch` reads it (`parallel`: the sizes, when
        already known: a running launch's). Raises ConfigError."""
        distributed = str(raw.get("distributed_type", "NO")).upper()
        world = int(raw.get("num_processes", 1) or 1)
        machines = int(raw.get("num_machines", 1) or 1)
        mixed = str(raw.get("mixed_precision", "no")).lower()
        if mixed not in COMPUTE_BYTES:
            raise ConfigError(f"mixed_precision {mixed!r} in {where} is not one of no, bf16, fp16, fp8")
        if world < 1:
            raise ConfigError(f"num_processes in {where} must be >= 1, got {world}")
        if distributed in DATA_PARALLEL_TYPES:
            return cls.data_parallel(1 if distributed == "NO" else world, machines, mixed, parallel)
        if distributed != "FSDP":
            raise ConfigError(f"distributed_type {distributed} in {where}: the estimator knows FSDP, MULTI_GPU and NO")
        fsdp = fsdp_settings(raw)
        version = int(fsdp.get("fsdp_version", 1))
        reshard = True
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
        # The sizes (FSDP1's strategy or parallelism_config); context parallelism and sizes that do not multiply to
        # num_processes raise: a layout that cannot run here is not one to estimate or list.
        parallel = ParallelDims.from_accelerate_config(raw, where=where) if parallel is None else parallel
        # FSDP1 saves full state dicts unless told otherwise, FSDP2 sharded ones (the plugin's defaults).
        state_dict_type = fsdp.get("fsdp_state_dict_type") or (
            "FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT"
        )
        return cls(
            parallel=parallel,
            num_machines=machines,
            distributed_type="FSDP",
            fsdp_version=version,
            reshard_after_forward=reshard,
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
        )

    @classmethod
    def from_accelerator(cls, accelerator, parallel: ParallelDims) -> LaunchLayout:
        """The layout of a running launch, from accelerate's resolved state and the run's sizes (`parallel`, what the
        launcher exported: ParallelDims.from_environment); no collectives."""
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
                },
                parallel=parallel,
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
        return cls.from_mapping(raw, where="the running launch", parallel=parallel)
