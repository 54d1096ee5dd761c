"""What is wrong with an Accelerate YAML, before it costs GPU hours: `fsdp-recipes validate-config FILE`.

Three layers, each run on what accelerate really uses:
- the file: keys accelerate rejects or silently drops (every misspelled `fsdp_config` key is dropped without a word),
  keys FSDP2 ignores, the FSDP1 strategy under the key the launcher ignores, implicit NO_WRAP, node counts;
- the launch environment: the FSDP_* / PARALLELISM_CONFIG_* variables that `accelerate launch` exports for the file
  (computed with accelerate's own launcher code), checked by `lint_launch_environment` — the same checks a recipe runs
  at start-up on its real environment (`check_launch_environment`);
- optionally the model (a weightless copy): wrap classes it lacks, tied embeddings that a wrap policy would split.

Every finding says what to change. Facts relied on: ../shared/reference/accelerate-fsdp-notes.md, sections 1-2.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from unittest import mock

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.yaml_json import load_yaml_mapping
from fsdp_recipes.distributed import expert_parallel, sequence_parallel, tensor_parallel
from fsdp_recipes.distributed.accelerate_config import STATE_DICT_TYPES, WRAP_POLICIES, fsdp_settings
from fsdp_recipes.distributed.parallel_dims import FSDP1_STRATEGIES, ParallelDims, context_parallel_problem

ERROR, WARNING, NOTE = "error", "warning", "note"
# Keys the launcher exports although FSDP2's plugin never reads them (or drops them with a warning).
FSDP2_IGNORED = {
    "fsdp_sharding_strategy": "FSDP2 has no sharding strategy; use fsdp_reshard_after_forward: true (FULL_SHARD) or "
    "false (SHARD_GRAD_OP), or a parallelism_config block for HYBRID_SHARD",
    "fsdp_backward_prefetch": "FSDP2 prefetches on its own; remove the key",
    "fsdp_forward_prefetch": "FSDP2 does not implement forward prefetch; remove the key",
    "fsdp_use_orig_params": "FSDP2 always uses the original parameters; remove the key",
}


@dataclass(frozen=True)
class Finding:
    # ERROR: the run would fail or silently do something else; WARNING: probably not what you meant; NOTE: the file
    # is right, and this machine lacks something its launch needs (a package)
    severity: str
    key: str
    message: str  # what is wrong and what to change

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}"


def _launcher_keys(prefix: str) -> set[str]:
    """The keys accelerate's launcher reads under `fsdp_config` / `parallelism_config`: its own argument names."""
    from accelerate.commands.launch import launch_command_parser

    keys = {action.dest for action in launch_command_parser()._actions if action.dest.startswith(prefix)}
    if prefix == "fsdp_":
        keys.add("fsdp_ignored_modules")  # read by the launcher although it has no command-line flag
    return keys


def _closest(key: str, valid: set[str], hint_for: Mapping[str, str] = {}) -> str:
    if key in hint_for:
        return hint_for[key]
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(valid))}"


# --- the file ----------------------------------------------------------------------------------------------------
def lint_config_dict(raw: dict) -> list[Finding]:
    """Findings that only the YAML text shows (the launcher drops or rewrites these before any environment exists)."""
    from accelerate.commands.config.config_args import ClusterConfig

    findings: list[Finding] = []
    top_level = {f.name for f in fields(ClusterConfig)}
    for key in sorted(set(raw) - top_level):
        findings.append(Finding(ERROR, key, f"accelerate refuses unknown top-level keys; {_closest(key, top_level)}"))

    fsdp = fsdp_settings(raw)
    distributed_type = str(raw.get("distributed_type", ""))
    if distributed_type == "FSDP":
        findings += _lint_fsdp_keys(fsdp)
    elif fsdp:
        findings.append(
            Finding(
                WARNING,
                "fsdp_config",
                f"ignored: distributed_type is {distributed_type or 'missing'}; set distributed_type: FSDP or remove it",
            )
        )
    findings += _lint_parallelism_keys(raw.get("parallelism_config") or {}, fsdp, distributed_type)
    findings += _lint_machines(raw)
    return findings


def _lint_fsdp_keys(keys: dict) -> list[Finding]:
    """`keys`: the fsdp_config block under the launcher's names (`fsdp_settings`)."""
    valid = _launcher_keys("fsdp_")
    hints = {
        "fsdp_mixed_precision": "mixed precision is the top-level mixed_precision key, not an fsdp_config key",
        "fsdp_backward_prefetch_policy": "did you mean 'fsdp_backward_prefetch'?",
        "fsdp_hybrid_shard": "FSDP2 HSDP is a top-level parallelism_config block "
        "(parallelism_config_dp_replicate_size, parallelism_config_dp_shard_size)",
    }
    findings = [
        Finding(
            ERROR,
            f"fsdp_config.{key}",
            f"unknown key: accelerate drops it without a word; {_closest(key, valid, hints)}",
        )
        for key in sorted(set(keys) - valid)
    ]
    version = str(keys.get("fsdp_version", "1"))
    if "fsdp_version" not in keys:
        findings.append(
            Finding(
                WARNING,
                "fsdp_config.fsdp_version",
                "omitted: the launcher then uses FSDP1; write fsdp_version: 2 (or 1)",
            )
        )
    if "fsdp_auto_wrap_policy" not in keys:
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_auto_wrap_policy",
                "omitted, so NO_WRAP: the whole model becomes one FSDP unit (FSDP2: only the root is sharded) and every "
                "step gathers all parameters at once; write fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP (or NO_WRAP if "
                "that is really meant)",
            )
        )
    reshard = keys.get("fsdp_reshard_after_forward")
    if version == "1":
        if isinstance(reshard, str) and reshard.upper() in FSDP1_STRATEGIES and reshard.upper() != "FULL_SHARD":
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_reshard_after_forward",
                    f"{reshard} is ignored under FSDP1: the launcher always exports FSDP_SHARDING_STRATEGY (default "
                    f"FULL_SHARD), which wins; write fsdp_sharding_strategy: {reshard.upper()} instead",
                )
            )
        if keys.get("fsdp_activation_checkpointing_offload") is True:
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_activation_checkpointing_offload",
                    "needs FSDP2 (accelerate raises): set fsdp_version: 2 or remove the key",
                )
            )
    else:
        for key, fix in FSDP2_IGNORED.items():
            if key in keys:
                findings.append(Finding(WARNING, f"fsdp_config.{key}", f"ignored by FSDP2: {fix}"))
    if keys.get("fsdp_sync_module_states") is False and keys.get("fsdp_cpu_ram_efficient_loading", True) is not False:
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_sync_module_states",
                "false while fsdp_cpu_ram_efficient_loading is true (its launcher default when omitted): accelerate launch "
                "refuses this; set fsdp_sync_module_states: true, or fsdp_cpu_ram_efficient_loading: false explicitly",
            )
        )
    for key in ("fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type", "fsdp_offload_params"):
        if key not in keys:
            findings.append(
                Finding(
                    WARNING,
                    f"fsdp_config.{key}",
                    "omitted: the launcher's default applies, which is not the plugin's; write it explicitly",
                )
            )
    policy = str(keys.get("fsdp_auto_wrap_policy", "")).upper()
    if policy == "SIZE_BASED_WRAP" and "fsdp_min_num_params" not in keys:
        findings.append(
            Finding(
                WARNING,
                "fsdp_config.fsdp_min_num_params",
                "omitted with SIZE_BASED_WRAP: the launcher's default is 1e8 parameters per unit; write the value you want",
            )
        )
    if "fsdp_transformer_layer_cls_to_wrap" in keys and policy and policy != "TRANSFORMER_BASED_WRAP":
        findings.append(
            Finding(
                WARNING,
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                f"ignored with fsdp_auto_wrap_policy {policy}; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP or "
                "remove the key",
            )
        )
    return findings


def _lint_parallelism_keys(parallelism: dict, fsdp: dict, distributed_type: str) -> list[Finding]:
    if not parallelism:
        return []
    valid = _launcher_keys("parallelism_config_") | {expert_parallel.CONFIG_KEY}  # ep: read by the recipes themselves
    findings = []
    for key in sorted(set(parallelism) - valid):
        hint = (
            f"the keys need the prefix: parallelism_config_{key}"
            if f"parallelism_config_{key}" in valid
            else _closest(key, valid)
        )
        findings.append(Finding(ERROR, f"parallelism_config.{key}", f"unknown key: the launcher ignores it; {hint}"))
    version = str(fsdp.get("fsdp_version", "1"))
    if distributed_type != "FSDP" or version != "2":
        findings.append(
            Finding(
                ERROR,
                "parallelism_config",
                "needs distributed_type: FSDP with fsdp_version: 2 (accelerate launch refuses it otherwise); for FSDP1 "
                "hybrid sharding write fsdp_sharding_strategy: HYBRID_SHARD instead",
            )
        )
    return findings


def _lint_machines(raw: dict) -> list[Finding]:
    processes, machines = raw.get("num_processes"), raw.get("num_machines", 1) or 1
    if not isinstance(processes, int) or processes < 1:
        return [Finding(ERROR, "num_processes", "missing: write the total number of processes over all nodes")]
    if processes % machines:
        return [
            Finding(
                ERROR,
                "num_processes",
                f"{processes} processes over {machines} machines: the launcher starts {processes // machines} per node "
                f"and silently drops the rest; num_processes is the GLOBAL count, nodes x GPUs per node",
            )
        ]
    return []


# --- the launch environment --------------------------------------------------------------------------------------
def exported_environment(config_file: str | Path) -> dict[str, str]:
    """The ACCELERATE_* / FSDP_* / PARALLELISM_CONFIG_* variables `accelerate launch --config_file FILE` would export,
    plus WORLD_SIZE, computed with accelerate's own launcher code (private API, accelerate 1.15) and no GPU.
    Raises ValueError where the launcher would refuse the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "script.py"])
    _validate_launch_command(args)
    environment = {"WORLD_SIZE": str(args.num_processes)}
    if args.use_fsdp or args.multi_gpu:
        # Nothing is started here, and the environment is the file's wherever it runs: a machine without a float8
        # library (a login node) is told so apart (float8.machine_note), not refused.
        with (
            mock.patch.object(launch_utils, "is_port_in_use", return_value=False),
            mock.patch.object(launch_utils, "is_fp8_available", return_value=True),
        ):
            exported = launch_utils.prepare_multi_gpu_env(args)
        prefixes = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
        environment |= {k: v for k, v in exported.items() if k.startswith(prefixes) and os.environ.get(k) != v}
        if environment.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
            # what each rank reads from this file itself (the launcher does not export it)
            ep = expert_parallel.size_in_config(load_yaml_mapping(config_file))
            environment[expert_parallel.ENVIRONMENT] = str(ep)
    return environment


def lint_launch_environment(
    environ: Mapping[str, str],
    *,
    parallel: ParallelDims | None = None,
    local_device_count: int | None = None,
    has_cuda: bool | None = None,
) -> list[Finding]:
    """Checks on what the launcher exported (`parallel`: its layout, read from `environ` if not given).
    `local_device_count`: accelerators on this node, if any; `has_cuda`: whether this machine has CUDA (None: not
    known, the file checked offline)."""
    parallel = ParallelDims.from_environment(environ) if parallel is None else parallel
    cp_problem = context_parallel_problem(parallel.cp, has_cuda=has_cuda)
    refused = (
        ({"parallelism_config.parallelism_config_cp_size": cp_problem} if cp_problem else {})
        | tensor_parallel.problems(parallel, environ)
        | sequence_parallel.layout_problems(parallel, environ)
    )
    findings = [Finding(ERROR, key, problem) for key, problem in refused.items()]
    world_size = int(environ.get("WORLD_SIZE", "1"))
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        findings += _lint_fsdp_environment(environ)
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        sizes = {
            name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
            for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")
        }
        product = 1
        for size in sizes.values():
            product *= size
        if product != world_size:
            shown = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "1"
            findings.append(
                Finding(
                    ERROR,
                    "parallelism_config",
                    f"{shown} = {product} processes, but the launch has {world_size}: make "
                    f"parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size x "
                    f"parallelism_config_tp_size = {world_size} (x parallelism_config_sp_size where set; num_processes is the global count over all nodes)",
                )
            )
        elif (
            sizes["dp_shard"] * sizes["cp"] * sizes["tp"] * sizes["sp"] == 1
            and environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        ):
            findings.append(
                Finding(
                    ERROR,
                    "parallelism_config.parallelism_config_dp_shard_size",
                    "is 1: FSDP has nothing to shard over; for HSDP set it to the GPUs per replica (e.g. GPUs per node)",
                )
            )
    local_world = environ.get("LOCAL_WORLD_SIZE")
    if local_device_count and local_world and int(local_world) > local_device_count:
        findings.append(
            Finding(
                ERROR,
                "num_processes",
                f"{local_world} processes on a node with {local_device_count} accelerators: num_processes is the GLOBAL "
                "count; set it to nodes x GPUs per node and num_machines to the number of nodes",
            )
        )
    return findings


def _lint_fsdp_environment(environ: Mapping[str, str]) -> list[Finding]:
    findings = []
    version = environ.get("FSDP_VERSION", "1")
    policy = environ.get("FSDP_AUTO_WRAP_POLICY")
    if policy is None:
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_auto_wrap_policy",
                "not set, so NO_WRAP: the whole model is one FSDP unit; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP "
                "in the Accelerate config (or NO_WRAP explicitly if that is really meant)",
            )
        )
    elif policy.upper() not in WRAP_POLICIES:
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_auto_wrap_policy",
                f"{policy!r} is not a policy; use one of {', '.join(WRAP_POLICIES)}",
            )
        )
    state_dict_type = environ.get("FSDP_STATE_DICT_TYPE")
    if state_dict_type is not None and state_dict_type.upper() not in STATE_DICT_TYPES:
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_state_dict_type",
                f"{state_dict_type!r} is not a state-dict type; use SHARDED_STATE_DICT or FULL_STATE_DICT",
            )
        )
    reshard = environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    if version == "2":
        if reshard not in ("true", "false"):
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_reshard_after_forward",
                    f"{reshard.upper()} under FSDP2, which takes a bool: write true (FULL_SHARD) or false (SHARD_GRAD_OP)",
                )
            )
        if (state_dict_type or "").upper() == "LOCAL_STATE_DICT":
            findings.append(
                Finding(
                    ERROR, "fsdp_config.fsdp_state_dict_type", "FSDP2 has no LOCAL_STATE_DICT; use SHARDED_STATE_DICT"
                )
            )
        if environ.get("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH").upper() != "NO_PREFETCH":
            findings.append(Finding(WARNING, "fsdp_config.fsdp_backward_prefetch", "ignored by FSDP2; remove the key"))
        if environ.get("FSDP_FORWARD_PREFETCH", "false").lower() == "true":
            findings.append(Finding(WARNING, "fsdp_config.fsdp_forward_prefetch", "ignored by FSDP2; remove the key"))
    else:
        strategy = environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        if reshard.upper() in FSDP1_STRATEGIES and reshard.upper() != strategy:
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_reshard_after_forward",
                    f"{reshard.upper()} is ignored under FSDP1 and {strategy} is used; write fsdp_sharding_strategy: "
                    f"{reshard.upper()} instead",
                )
            )
        if environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false").lower() == "true":
            findings.append(
                Finding(ERROR, "fsdp_config.fsdp_activation_checkpointing_offload", "needs FSDP2: set fsdp_version: 2")
            )
    if (
        environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false").lower() == "true"
        and environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() != "true"
    ):
        findings.append(
            Finding(
                ERROR,
                "fsdp_config.fsdp_activation_checkpointing_offload",
                "needs fsdp_activation_checkpointing: true (accelerate raises)",
            )
        )
    return findings


def check_launch_environment(environ: Mapping[str, str], *, parallel: ParallelDims | None = None) -> list[Finding]:
    """For recipes, at start-up: the launch-environment checks on this process's real environment and the layout read
    from it once (`ParallelDims.from_environment`, in run.starting). Raises ConfigError listing every error; returns
    the warnings (for the recipe to print)."""
    import torch

    device_count = torch.accelerator.device_count() if torch.accelerator.is_available() else None
    findings = lint_launch_environment(
        environ, parallel=parallel, local_device_count=device_count, has_cuda=torch.cuda.is_available()
    )
    errors = [
        f"the Accelerate config: {finding.key}: {finding.message}" for finding in findings if finding.severity == ERROR
    ]
    if errors:
        raise ConfigError(errors)
    return [finding for finding in findings if finding.severity == WARNING]
