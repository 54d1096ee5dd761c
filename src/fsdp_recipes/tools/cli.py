"""The `fsdp-recipes` command. Each subcommand is one function decorated with `@subcommand`: it receives its own
argparse parser to fill and returns the function that runs it (which returns the exit status). Adding a
subcommand is adding one such function to this file. Every parser is built at start-up, so the module a subcommand
runs is imported by its runner: most of them import torch, transformers or peft (seconds) that the others never need."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.common.errors import ConfigError, UserError
from fsdp_recipes.common.sizes import parse_size
from fsdp_recipes.tools.estimator.arguments import add_estimate_arguments

DESCRIPTION = (
    "The tools around FSDP Recipes' training scripts: list, copy and adapt the recipes and their configs, check an "
    "Accelerate config, estimate the memory per GPU of a model under a layout, export a training checkpoint, translate "
    "a DeepSpeed config, start vLLM's server for a run to generate through."
)
EPILOG = (
    "Training itself is a launch of a recipe: accelerate launch --config_file accelerate_configs/<topology>.yaml "
    "recipes/<recipe>.py --config recipes/configs/<recipe>/<config>.yaml"
)
Runner = Callable[[argparse.Namespace], int]
_SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], Runner]]] = []


def subcommand(name: str, help: str):
    def register(define: Callable[[argparse.ArgumentParser], Runner]):
        _SUBCOMMANDS.append((name, help, define))
        return define

    return register


@subcommand("configs", help="the Accelerate configs generated from accelerate_configs/topologies.yaml")
def configs_command(parser: argparse.ArgumentParser) -> Runner:
    actions = parser.add_subparsers(dest="action", required=True)
    generate = actions.add_parser("generate", help="write accelerate_configs/*.yaml and the table of its README.md")
    generate.add_argument("--check", action="store_true", help="write nothing; exit 1 if a checked-in file is stale")
    generate.add_argument("--config-dir", type=Path, default=None, help="default: the repository's accelerate_configs/")

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.tools import topology

        config_dir = args.config_dir or topology.CONFIG_DIR
        if args.check:
            stale = topology.stale_files(config_dir)
            for path in stale:
                print(f"stale: {path} differs from what `fsdp-recipes configs generate` writes", file=sys.stderr)
            if stale:
                print("fix: run `fsdp-recipes configs generate` and commit the result", file=sys.stderr)
                return 1
            print(f"all generated files in {config_dir} are up to date")
            return 0
        changed = topology.generate(config_dir)
        for path in changed:
            print(f"wrote {path}")
        print(f"{len(changed)} file(s) changed" if changed else "nothing to change")
        return 0

    return run


@subcommand("validate-config", help="report what is wrong with an Accelerate YAML, and how to fix it")
def validate_config_command(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("config_file", type=Path, metavar="FILE", help="an Accelerate config YAML")
    parser.add_argument(
        "--model",
        metavar="NAME_OR_PATH_OR_CONFIG",
        help="also check wrap classes and tied embeddings against this model (Hub id, folder, config.json)",
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--print-env",
        action="store_true",
        help="also print the FSDP_*/ACCELERATE_* variables `accelerate launch` would export (for torchrun)",
    )

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.distributed.launch_checks import ERROR, NOTE, WARNING, exported_environment
        from fsdp_recipes.tools.linter import lint_config_file

        findings = lint_config_file(args.config_file, model=args.model, trust_remote_code=args.trust_remote_code)
        for finding in findings:
            print(f"{args.config_file}: {finding}")
        errors, warnings, notes = (sum(f.severity == kind for f in findings) for kind in (ERROR, WARNING, NOTE))
        about_machine = f", {notes} note(s) about this machine" if notes else ""
        print(f"{args.config_file}: {errors} error(s), {warnings} warning(s){about_machine}")
        if args.print_env and not errors:
            for key, value in exported_environment(args.config_file).items():
                print(f"export {key}={value}")
        return 1 if errors else 0

    return run


@subcommand("estimate", help="memory per GPU for a model under an Accelerate config, before launching")
def estimate_command(parser: argparse.ArgumentParser) -> Runner:
    add_estimate_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.tools.estimator.command import run_estimate

        return run_estimate(args)

    return run


@subcommand("export", help="turn a training checkpoint into a Hugging Face model folder, on one CPU process")
def export_command(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoints/step-* folder (or OUTPUT_DIR/checkpoints/latest's target)",
    )
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="an empty or new folder")
    parser.add_argument(
        "--max-shard-size",
        type=parse_bytes,
        default="5GB",
        help="largest safetensors file to write, e.g. 5GB, 500MB (RAM use is about one file)",
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUTPUT_DIR")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="LoRA checkpoints: also write OUTPUT_DIR/merged, the base with the adapter merged in (loads "
        "the base model named in the checkpoint's recipe config)",
    )

    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="dtype of the written weights (auto: the run's export_dtype, by default the base model's dtype; "
        "float32 doubles the folder of a bf16 model and gains nothing for inference)",
    )

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.publish.checkpoint_export import export_checkpoint

        folder = export_checkpoint(
            args.checkpoint,
            args.output_dir,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            merged=args.merged,
            dtype=args.dtype,
        )
        print(f"exported {args.checkpoint} to {folder}")
        return 0

    return run


@subcommand(
    "ls",
    help="every recipe and config: model, method (+ images: trains on pictures), Accelerate config, memory per GPU",
)
def ls_command(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("text", nargs="?", help="only recipes and configs whose names contain this text")
    parser.add_argument(
        "--check",
        action="store_true",
        help="also check each config as the tests do (its launch command, the Accelerate config with "
        "the linter, the model's wrap classes, the memory estimate); exit 1 on a problem",
    )

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.tools.catalog import Catalog
        from fsdp_recipes.tools.listing import listing

        catalog = Catalog()
        print("\n".join(listing(catalog, args.text)))
        if not args.check:
            return 0
        problems = [
            f"{config.key}: {problem}"
            for config in catalog.configs()
            if not args.text or args.text in config.key
            for problem in catalog.problems(config)
        ]
        print("\n" + ("\n".join(problems) if problems else "every config passes its checks"))
        return 1 if problems else 0

    return run


@subcommand("cp", help="copy a recipe or a config, with what it needs, to adapt it")
def cp_command(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "name",
        metavar="NAME",
        help="a recipe (sft: the script and all its configs) or a config (sft/demo_reverse, or "
        "demo_reverse: the config, its recipe and the files it names)",
    )
    parser.add_argument(
        "dest",
        type=Path,
        metavar="DEST",
        help="a folder (files keep their relative paths, so the commands in them run from there), or a "
        ".py/.yaml path to copy only the recipe or config itself",
    )
    parser.add_argument("--force", action="store_true", help="overwrite copied files that exist and differ")
    parser.add_argument(
        "--with-method",
        action="store_true",
        help="also copy the method packages the recipe uses (fsdp_recipes/methods/<method>/) beside it, as "
        "recipes/methods/, its imports pointed there: the method's data, loss and settings become yours to edit",
    )

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.tools.catalog import Catalog

        print("\n".join(Catalog().copy(args.name, args.dest, force=args.force, with_method=args.with_method)))
        return 0

    return run


@subcommand("rehearse", help="run your own launch line on CPU in minutes: real sizes checked, stand-ins trained")
def rehearse_command(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "launch",
        nargs=argparse.REMAINDER,
        metavar="-- LAUNCH LINE",
        help="after --: accelerate launch --config_file X.yaml recipes/R.py --config C.yaml [--field value ...] (or "
        "the same without the launcher's words)",
    )
    parser.add_argument(
        "--processes", type=int, help="CPU processes (default: each dimension the real mesh splits, split 2 ways)"
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps (a checkpoint halfway, resumed from)")
    parser.add_argument("--rows", type=int, default=200, help="rows of each split the recipe reads")
    parser.add_argument(
        "--work-dir", type=Path, default=Path("outputs/rehearsal"), help="stand-ins, runs and the report (replaced)"
    )
    parser.add_argument(
        "--local",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a local stand-in for a Hub id (a model folder with config.json and tokenizer files, or a dataset "
        "file or folder); repeatable",
    )

    def run(args: argparse.Namespace) -> int:
        from fsdp_recipes.tools.rehearsal.command import rehearse

        locals_ = {}
        for pair in args.local:
            name, equals, path = pair.partition("=")
            if not equals or not name or not path:
                raise ConfigError(f"--local {pair!r}: give it as NAME=PATH (a Hub id and a local folder or file)")
            if not Path(path).exists():
                where = "" if Path(path).is_absolute() else f" (looked for {Path(path).resolve()})"
                raise ConfigError(
                    f"--local {pair}: the folder {path} does not exist{where}: give the "
                    "folder holding the model's config.json and tokenizer files, or the dataset's file or folder"
                )
            locals_[name] = path
        if args.steps < 2:
            raise ConfigError("--steps must be >= 2: a checkpoint halfway and a resume from it")
        words = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
        return rehearse(
            words, processes=args.processes, steps=args.steps, rows=args.rows, work_dir=args.work_dir, locals_=locals_
        )

    return run


@subcommand(
    "vllm-serve", help="start vLLM's server for a model, ready for runs that generate through it (use_vllm: true)"
)
def vllm_serve_command(parser: argparse.ArgumentParser) -> Runner:
    from fsdp_recipes.tools.vllm_serve import add_arguments, run

    add_arguments(parser)
    return run


@subcommand("from-deepspeed", help="the FSDP2 Accelerate config and recipe fields equivalent to a DeepSpeed config")
def from_deepspeed_command(parser: argparse.ArgumentParser) -> Runner:
    from fsdp_recipes.tools.from_deepspeed import add_arguments, run

    add_arguments(parser)
    return run


def parse_bytes(text: str) -> int:
    """'5GB', '500MB', '141GiB' or a plain number of bytes (fsdp_recipes.common.sizes reads it)."""
    try:
        return parse_size(text, minimum=1)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 5GB, 500MB, 141GiB") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-recipes", description=DESCRIPTION, epilog=EPILOG)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help, define in _SUBCOMMANDS:
        command_parser = commands.add_parser(name, help=help, description=help)
        command_parser.set_defaults(run=define(command_parser))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
