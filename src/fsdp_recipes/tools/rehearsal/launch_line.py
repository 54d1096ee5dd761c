"""A user's launch line, read as the launcher and the recipe would read it: `accelerate launch [launcher options]
recipes/R.py --config C.yaml [--field value ...]` (or `python recipes/R.py ...`, or the script and its arguments
alone). Nothing is run: `parse_launch` says which Accelerate config, which recipe and which recipe arguments, and
`recipe_values` what the recipe config holds once the command line's overrides are applied (raw values, the YAML's
and the flags', for the stand-ins: which model, tokenizer, dataset)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.yaml_json import load_yaml_mapping

# accelerate launch's options that take a value, and what a rehearsal does with them
_LAUNCHER_VALUE_OPTIONS = {
    "--config_file": "kept (scaled)",
    "--config-file": "kept (scaled)",
    "--num_processes": "the real mesh's size; the rehearsal's is --processes",
    "--num_machines": "one machine",
    "--machine_rank": "one machine",
    "--main_process_ip": "one machine",
    "--main_process_port": "a free local port",
    "--rdzv_backend": "static, one machine",
    "--mixed_precision": "kept",
    "--gpu_ids": "no GPU",
}
_LAUNCHER_FLAGS = ("--multi_gpu", "--use_fsdp", "--same_network", "--cpu")


@dataclasses.dataclass
class Launch:
    recipe: Path  # the recipe script
    recipe_args: list[str]  # everything after it
    accelerate_config: Path | None  # --config_file, None: a plain `python recipes/R.py`
    mixed_precision: str | None = None  # `accelerate launch --mixed_precision`, over the config's
    num_processes: int | None = None  # `accelerate launch --num_processes`, over the config's (the real mesh's size)
    launcher_notes: list[str] = dataclasses.field(default_factory=list)  # launcher options not kept as given
    fsdp_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # `--fsdp_*` flags, over its fsdp_config


def parse_launch(words: list[str] | str) -> Launch:
    """The launch line's parts; ConfigError when it is not a recipe launch."""
    words = shlex.split(words) if isinstance(words, str) else list(words)
    if words[:1] == ["--"]:
        words = words[1:]
    if words[:2] == ["accelerate", "launch"]:
        words = words[2:]
    elif words[:1] and Path(words[0]).name.startswith("python"):
        words = words[1:]
    config_file, mixed_precision, num_processes, notes, index, fsdp = None, None, None, [], 0, {}
    while index < len(words) and words[index].startswith("--"):
        option, has_equals, inline = words[index].partition("=")
        if option.startswith("--fsdp_") and (has_equals or index + 1 < len(words)):
            # an fsdp_config key (the wrap classes a shipped config names): kept, over the Accelerate config's
            value = inline if has_equals else words[index + 1]
            fsdp[option[2:]] = yaml.safe_load(value) if value.lower() in ("true", "false") else value
            index += 1 if has_equals else 2
        elif option in _LAUNCHER_VALUE_OPTIONS:
            value = inline if has_equals else (words[index + 1] if index + 1 < len(words) else "")
            index += 1 if has_equals else 2
            if option in ("--config_file", "--config-file"):
                config_file = Path(value)
            elif option == "--mixed_precision":
                mixed_precision = value
            elif option == "--num_processes" and value.isdigit():
                num_processes = int(value)  # the real run's size: the real mesh and the estimate read it
            else:
                notes.append(f"{option} {value}: {_LAUNCHER_VALUE_OPTIONS[option]}")
        elif option in _LAUNCHER_FLAGS:
            index += 1
        else:
            raise ConfigError(
                f"{option} is not an accelerate launch option a rehearsal knows: give the launch line as "
                "`accelerate launch --config_file X.yaml recipes/R.py --config C.yaml [--field value ...]`"
            )
    if index >= len(words) or not words[index].endswith(".py"):
        raise ConfigError(
            "this is not a recipe launch (no recipes/<recipe>.py in it): give it as `accelerate launch --config_file "
            "X.yaml recipes/R.py --config C.yaml [--field value ...]`"
        )
    recipe = Path(words[index])
    if not recipe.is_file():
        raise ConfigError(f"the recipe {recipe} does not exist (paths are read from the current folder)")
    if "fsdp_recipes" not in recipe.read_text(errors="replace"):  # a recipe, or a copy `fsdp-recipes cp` made
        from fsdp_recipes.tools.catalog import Catalog

        names = ", ".join(f"{recipe.name}.py" for recipe in Catalog().recipes())
        raise ConfigError(
            f"{recipe} is not one of this repository's recipes: rehearse runs those ({names}, or copies of them made "
            "with `fsdp-recipes cp`) with stand-ins for your model and data; start from the closest one "
            "(`fsdp-recipes cp sft my_recipes/`) and rehearse its launch line"
        )
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"the Accelerate config {config_file} does not exist")
    return Launch(recipe, words[index + 1 :], config_file, mixed_precision, num_processes, notes, fsdp)


def recipe_values(launch: Launch) -> dict[str, Any]:
    """The recipe config's values with the command line's `--field value` overrides applied (YAML-read, so `null`,
    numbers and lists mean what they mean in the file); ConfigError when the config file cannot be read."""
    args, values, index = launch.recipe_args, {}, 0
    overrides = {}
    while index < len(args):
        name, has_equals, inline = args[index][2:].partition("=") if args[index].startswith("--") else ("", "", "")
        if not name:
            index += 1
            continue
        value = inline if has_equals else (args[index + 1] if index + 1 < len(args) else "true")
        flag_alone = not has_equals and (index + 1 >= len(args) or args[index + 1].startswith("--"))
        index += 1 if has_equals or flag_alone else 2
        if name == "config":
            values = load_yaml_mapping(value)
        elif flag_alone:
            overrides[name] = True
        else:
            try:  # as the YAML file would hold it; a value YAML cannot read (`*`, `@...`) stays text
                overrides[name] = yaml.safe_load(value)
            except yaml.YAMLError:
                overrides[name] = value
    return {**values, **overrides}
