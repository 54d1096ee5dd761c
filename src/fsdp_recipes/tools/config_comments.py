"""What a recipe config's opening comment says: the `accelerate launch` command it is meant for, and so the recipe
script that reads it. Every shipped config opens with one:

    #   accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/sft.py \\
    #       --config recipes/configs/sft/<name>.yaml

It is parsed with accelerate's own launch parser, so that launcher flags written there (`--num_processes 1`,
`--fsdp_transformer_layer_cls_to_wrap ...`) count as they would at launch. Used by the catalog (`fsdp-recipes ls`,
`cp`) and the estimator (`fsdp-recipes estimate --recipe-config`, which reads the config with its recipe's class).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shlex
from pathlib import Path
from typing import Any

from accelerate.commands.launch import launch_command_parser

from fsdp_recipes.common.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LaunchCommand:
    """The `accelerate launch` line of a config's opening comment."""

    accelerate_config: str | None  # as written, relative to the root
    overrides: dict[str, Any]  # launcher flags given explicitly (accelerate's argument names): they win over the YAML
    script: str
    script_args: list[str]

    @property
    def recipe_config(self) -> str | None:
        args = self.script_args
        return next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--config"), None)


def opening_comment(text: str) -> list[str]:
    """The comment lines before the first setting, without their '#'."""
    lines = []
    for line in text.splitlines():
        if line.startswith("#"):
            lines.append(line[1:])
        elif line.strip():
            break
    return lines


def parse_launch_command(comment: list[str], *, where: str, config_file: Path | None = None) -> LaunchCommand | None:
    """The `accelerate launch` command of a config's opening comment. A comment may also give the command of a step
    to run before (the SFT demo before the DPO demo): the command whose `--config` names `config_file` is the one
    that launches it, else the first."""
    starts = [i for i, line in enumerate(comment) if line.strip().startswith("accelerate launch")]
    if not starts:
        return None
    commands = [_parse_one(comment, start, where=where) for start in starts]
    if config_file is not None:
        own = Path(config_file).as_posix()
        for command in commands:
            if command.recipe_config and own.endswith(command.recipe_config.removeprefix("./")):
                return command
    return commands[0]


def _parse_one(comment: list[str], start: int, *, where: str) -> LaunchCommand:
    parts = []
    for line in comment[start:]:
        parts.append(line.strip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    # Shell variables ($NODE_RANK) stand for values given at launch; any number parses where one is expected.
    tokens = ["0" if token.startswith("$") else token for token in shlex.split(" ".join(parts))]
    parser = launch_command_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            args = parser.parse_args(tokens[2:])
    except SystemExit:
        raise ConfigError(
            f"{where}: the launch command in its opening comment is not one accelerate launch "
            f"accepts ({stderr.getvalue().strip().splitlines()[-1]})"
        ) from None
    written = {token.split("=")[0] for token in tokens[2 : tokens.index(args.training_script)]}
    overrides = {
        action.dest: getattr(args, action.dest)
        for action in parser._actions
        if written & set(action.option_strings) and action.dest != "config_file"
    }
    return LaunchCommand(args.config_file, overrides, args.training_script, list(args.training_script_args))


def launched_script(config_file: Path) -> Path | None:
    """The recipe script a config file's opening comment launches, found from the working directory or a folder above
    the config (the command is written to run from the root of a checkout or a copy); None if there is no such
    comment or script."""
    launch = parse_launch_command(
        opening_comment(Path(config_file).read_text()), where=str(config_file), config_file=Path(config_file)
    )
    if launch is None:
        return None
    for folder in (Path.cwd(), *Path(config_file).resolve().parents):
        if (folder / launch.script).is_file():
            return folder / launch.script
    return None
