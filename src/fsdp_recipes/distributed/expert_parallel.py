"""Expert parallelism: a mixture of experts' routed experts split over `ep` ranks, through transformers' N-D engine
(`DistributedConfig(ep_size=...)`, the route of fsdp_recipes.distributed.tensor_parallel).

Where the size comes from. The Accelerate YAML says it, next to `tp`: `parallelism_config_ep_size` under
`parallelism_config`. Accelerate 1.15's launcher exports only the parallelism keys it knows (dp_replicate, dp_shard,
tp, cp, sp) as PARALLELISM_CONFIG_*_SIZE, so each rank reads this one key from the file the launch named itself: the
`accelerate launch` command that started the process (its `--config_file`, or accelerate's default config), found by
walking up the process tree (`/proc`, Linux). The size is then exported as PARALLELISM_CONFIG_EP_SIZE for the rest of
the run, so every later reader agrees; a launcher other than `accelerate launch` (torchrun, srun) exports that variable
itself, as it exports the others.

What the layout must satisfy (transformers' rules, checked before any weight loads, with the reason): `ep` a multiple
of `tp` and dividing `fsdp x tp` (the expert mesh is (dp_replicate, efsdp, ep) over the same ranks, efsdp = fsdp x tp /
ep); the model a mixture of experts with an expert-parallel plan; `ep` dividing its routed experts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

CONFIG_KEY = "parallelism_config_ep_size"
ENVIRONMENT = "PARALLELISM_CONFIG_EP_SIZE"
_ANCESTORS_SEARCHED = 6  # worker <- accelerate launch, or a wrapper or two (srun, a shell) in between


def size_in_config(raw: Mapping) -> int:
    """The `ep` an Accelerate config's mapping asks for (1 without one)."""
    value = (raw.get("parallelism_config") or {}).get(CONFIG_KEY, 1)
    return int(value or 1)


def export_launched_size(environ: MutableMapping[str, str] = os.environ) -> int:
    """This launch's `ep`: PARALLELISM_CONFIG_EP_SIZE when set, else read from the launching Accelerate config and
    exported. A launch with no parallelism_config has none (1), whatever a file says."""
    if ENVIRONMENT in environ:
        return int(environ[ENVIRONMENT] or 1)
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    config_file = launching_config_file()
    size = 1
    if config_file is not None:
        from fsdp_recipes.common.yaml_json import load_yaml_mapping

        size = size_in_config(load_yaml_mapping(config_file))
    environ[ENVIRONMENT] = str(size)
    return size


def launching_config_file(pid: int | None = None) -> Path | None:
    """The Accelerate config file of the `accelerate launch` above this process: its `--config_file`, resolved
    against that command's working directory, or accelerate's default config file. None when no such command is
    found (another launcher, or no /proc)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(_ANCESTORS_SEARCHED):
        try:
            words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except (OSError, ValueError, IndexError):
            return None
        if _is_accelerate_launch(words):
            named = launched_config_option(words)
            if named is not None:
                return cwd / named
            from accelerate.commands.config import default_config_file

            return Path(default_config_file) if Path(default_config_file).is_file() else None
        if parent <= 1:
            return None
        pid = parent
    return None


def _is_accelerate_launch(words: list[str]) -> bool:
    for index, word in enumerate(words[:4]):
        if word == "accelerate.commands.launch":
            return True
        if Path(word).name == "accelerate" and index + 1 < len(words) and words[index + 1] == "launch":
            return True
    return False


def launched_config_option(words: list[str]) -> str | None:
    """The `--config_file` of an `accelerate launch` command line, read by accelerate's own parser."""
    from accelerate.commands.launch import launch_command_parser

    rest = (
        words[words.index("launch") + 1 :]
        if "launch" in words
        else words[words.index("accelerate.commands.launch") + 1 :]
    )
    return launch_command_parser().parse_known_args(rest)[0].config_file


def layout_problems(*, ep: int, tp: int, dp_shard: int) -> list[str]:
    """transformers' mesh rules for `ep`, each with its fix."""
    if ep <= 1:
        return []
    problems = []
    if ep % tp:
        problems.append(
            f"{CONFIG_KEY} {ep} is not a multiple of parallelism_config_tp_size {tp}: each expert-parallel group "
            "spans whole TP groups; choose ep = tp x k"
        )
    if (dp_shard * tp) % ep:
        problems.append(
            f"{CONFIG_KEY} {ep} does not divide dp_shard x tp = {dp_shard * tp}: the experts are split over ep ranks "
            "and FSDP-sharded over the rest of those ranks (efsdp = dp_shard x tp / ep); choose an ep that divides it"
        )
    return problems


def model_problems(ep: int, model_config, model_class, num_experts: int | None) -> list[str]:
    """What keeps this model from `ep`-way expert parallelism: a dense model (`num_experts` None: the models layer
    reads it, fsdp_recipes.models.experts), no expert-parallel plan in the installed transformers, or routed experts
    that `ep` does not divide."""
    if ep <= 1:
        return []
    name = type(model_config).__name__.removesuffix("Config")
    if not num_experts:
        return [
            f"{CONFIG_KEY} {ep} on {name}, a dense model (no routed experts): set {CONFIG_KEY}: 1, or shard it with "
            "FSDP and TP alone"
        ]
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    plan = dict(getattr(model_class, "_ep_plan", None) or {}) | dict(getattr(text, "base_model_ep_plan", None) or {})
    if not plan:
        return [
            f"{name} has no expert-parallel plan (base_model_ep_plan) in the installed transformers: set "
            f"{CONFIG_KEY}: 1 and shard its experts with FSDP"
        ]
    if num_experts % ep:
        return [
            f"{CONFIG_KEY} {ep} does not divide {name}'s {num_experts} routed experts: choose an ep that does "
            "(each rank holds num_experts / ep of them)"
        ]
    return []
