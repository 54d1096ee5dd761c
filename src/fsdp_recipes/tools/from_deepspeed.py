"""`fsdp-recipes from-deepspeed ds_config.json -o accelerate_config.yaml`: the FSDP2 Accelerate config equivalent to a
DeepSpeed config, the recipe fields to set, and every DeepSpeed setting that has no FSDP equivalent.

Every key of the DeepSpeed file ends up in exactly one of three lists: mapped (to the Accelerate config or to a
recipe field), approximated (mapped to the nearest FSDP behaviour, with the difference said), or not carried over
(with the reason). Nothing is dropped without a word. `"auto"` values (what Hugging Face's DeepSpeed integration
writes, to be filled from the training arguments) are resolved where the FSDP side needs a value and otherwise left
to the recipe config, and listed either way. The YAML itself is written by the generator of the shipped configs
(fsdp_recipes.tools.topology), so it passes the linter. The mapping and its reasons: docs/from-deepspeed.md.

This module reads the file and writes the YAML; the translation is fsdp_recipes.tools.deepspeed_translation, the
settings with no FSDP counterpart and the reasons given for them fsdp_recipes.tools.deepspeed_keys.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError, UserError
from fsdp_recipes.tools.deepspeed_translation import Translation, translate
from fsdp_recipes.tools.topology import describe_hardware, launch_lines, render_body


def load_deepspeed_config(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"cannot read the DeepSpeed config {str(path)!r}: {error.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}): "
            "fix the file (a DeepSpeed config is one JSON object)"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not the object of settings DeepSpeed reads")
    return config


def render(translation: Translation, *, output: Path, source: Path) -> str:
    """The Accelerate YAML: a header saying where it comes from, how to launch it, the recipe fields and everything
    not carried over; then the body the shipped configs' generator writes for the topology."""
    layout = translation.layout
    launch = launch_lines(layout, str(output))
    nodes = f" (on every node, NODE_RANK 0..{layout.num_machines - 1})" if layout.num_machines > 1 else ""
    header = [
        f"# FSDP2 equivalent of the DeepSpeed config {source.name}, written by `fsdp-recipes from-deepspeed` "
        "(docs/from-deepspeed.md).",
        f"# {describe_hardware(layout)}.",
        f"# Launch{nodes}:",
        f"#   {launch[0]} \\",
        *[f"#       {line} \\" for line in launch[1:-1]],
        f"#       {launch[-1]}",
    ]
    if translation.recipe_fields:
        header.append("# Set in the recipe config (FSDP settings stay here; these are the recipe's):")
        header += [f"#   {line}" for line in recipe_fields_yaml(translation.recipe_fields).splitlines()]
    for title, items in (
        ("Approximated", translation.approximated),
        ("'auto' values", translation.auto),
        ("Not carried over (no FSDP equivalent)", translation.not_carried),
    ):
        if items:
            header.append(f"# {title}:")
            header += [f"#   - {item}" for item in items]
    header.append(f"# Check it against your model: fsdp-recipes validate-config {output} --model MODEL")
    return "\n".join(header + render_body(layout)) + "\n"


def recipe_fields_yaml(fields: dict[str, Any]) -> str:
    return yaml.safe_dump(fields, sort_keys=False, default_flow_style=False).strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_config", type=Path, metavar="DS_CONFIG", help="a DeepSpeed config JSON")
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the Accelerate config YAML to write"
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        metavar="N",
        help="processes over all nodes (default: from train_batch_size, else 8 per node)",
    )
    parser.add_argument("--num-machines", type=int, default=1, metavar="M", help="nodes (default 1)")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")


def run(args: argparse.Namespace) -> int:
    if args.num_machines < 1 or (args.num_processes is not None and args.num_processes < 1):
        raise ConfigError("--num-processes and --num-machines must be >= 1")
    if args.num_processes is not None and args.num_processes % args.num_machines:
        raise ConfigError(
            f"--num-processes {args.num_processes} is the global count: it must be a multiple of "
            f"--num-machines {args.num_machines}"
        )
    if args.output.exists() and not args.force:
        raise UserError(f"{args.output} exists: pass --force to overwrite it, or choose another -o")
    translation = translate(
        load_deepspeed_config(args.ds_config), num_processes=args.num_processes, num_machines=args.num_machines
    )
    layout = translation.layout
    if layout.parallel.world_size % layout.num_machines:
        raise ConfigError(
            f"{layout.parallel.world_size} processes do not split evenly over {layout.num_machines} machines"
        )
    text = render(translation, output=args.output, source=args.ds_config)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}: {describe_hardware(layout)}")
    for title, items in (
        ("mapped", translation.mapped),
        ("approximated", translation.approximated),
        ("'auto' values", translation.auto),
        ("not carried over", translation.not_carried),
    ):
        if items:
            print(f"\n{title}:")
            print("\n".join(f"  - {item}" for item in items))
    if translation.recipe_fields:
        print("\nset in the recipe config:")
        print("\n".join(f"  {line}" for line in recipe_fields_yaml(translation.recipe_fields).splitlines()))
    return 0
