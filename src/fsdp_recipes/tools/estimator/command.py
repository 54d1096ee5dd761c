"""`fsdp-recipes estimate` (and `python -m fsdp_recipes.tools.estimator`, with the same arguments): the estimate for a
model, an Accelerate config and optionally a recipe config, as text or one JSON object. Exit status 0: it fits; 1: it
does not; 2: bad input (one `error:` line)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from fsdp_recipes.common.errors import ConfigError, UserError
from fsdp_recipes.common.sizes import parse_reserve, parse_size
from fsdp_recipes.common.yaml_json import load_yaml_mapping
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools import estimator
from fsdp_recipes.tools.config_comments import launched_script
from fsdp_recipes.tools.estimator.arguments import add_estimate_arguments
from fsdp_recipes.tools.estimator.formulas import estimate_for_recipe
from fsdp_recipes.tools.estimator.recipe import recipe_config
from fsdp_recipes.tools.estimator.report import estimate_report, render_report
from fsdp_recipes.tools.estimator.shapes import load_model_info
from fsdp_recipes.tools.estimator.workload import workload_for


def run_estimate(args: argparse.Namespace) -> int:
    """`fsdp-recipes estimate`. Raises ConfigError (exit 2 through the CLI) on bad input."""
    gpu_memory = parse_size(args.gpu_memory)
    reserve = parse_reserve(args.reserve, gpu_memory)
    values = load_yaml_mapping(args.recipe_config) if args.recipe_config else {}
    if args.max_length is not None:
        values["max_length"] = args.max_length
    if args.batch_size is not None:
        values["per_device_train_batch_size"] = args.batch_size
    # The recipe the config's opening comment launches reads it (the shared TrainingConfig without one).
    script = launched_script(Path(args.recipe_config)) if args.recipe_config else None
    recipe = recipe_config(values, script=script, where=f"config file {str(args.recipe_config)!r}")
    workload = workload_for(recipe)
    if workload.row_length < 1 or workload.micro_batch_rows < 1:
        raise ConfigError("max_length and per_device_train_batch_size must be >= 1")
    model = args.model or recipe.model_config or recipe.model_name_or_path
    if not model:
        raise ConfigError("no model: pass --model (Hub id, folder or config.json) or a --recipe-config that names one")
    layout = LaunchLayout.from_file(args.accelerate_config)
    if args.num_processes is not None:
        if args.num_processes < 1:
            raise ConfigError("--num-processes must be >= 1")
        parallel = layout.parallel
        hsdp = 1 < parallel.shard_size < parallel.world_size
        if hsdp and args.num_processes % parallel.shard_size:
            raise ConfigError(
                f"--num-processes {args.num_processes} is not a multiple of the HSDP shard size {parallel.shard_size}"
            )
        # HSDP keeps its shards (more replicas), unsharded stays unsharded, a sharded copy spans every process; the
        # tensor- and sequence-parallel groups stay as they are
        shard = parallel.shard_size if hsdp or parallel.shard_size == 1 else args.num_processes
        fixed = (shard if shard < args.num_processes else parallel.sp) * parallel.tp
        if args.num_processes % fixed:
            raise ConfigError(
                f"--num-processes {args.num_processes} is not a multiple of {fixed}: the layout keeps its tensor-"
                f"parallel, sequence-parallel and FSDP shard groups as they are ({layout.describe()})"
            )
        replicate = args.num_processes // (shard * parallel.tp)
        parallel = dataclasses.replace(parallel, dp_replicate=replicate, dp_shard=shard // parallel.sp)
        layout = dataclasses.replace(layout, parallel=parallel)
    info = load_model_info(str(model), trust_remote_code=args.trust_remote_code)
    images_per_row = getattr(args, "images_per_row", None)
    if images_per_row is not None and info.vision is None:
        raise ConfigError(f"--images-per-row: {model} is a text-only model ({info.model_type}), it reads no pictures")
    est = estimate_for_recipe(
        info, layout, recipe, gpu_memory=gpu_memory, reserve=reserve, model_name=str(model),
        images_per_row=images_per_row,
    )  # fmt: skip
    report = estimate_report(est, info, recipe)
    if args.json:
        print(json.dumps(report, indent=None))
    else:
        print(render_report(report))
    return 0 if est.fits else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m fsdp_recipes.tools.estimator ...`: `fsdp-recipes estimate` on its own."""
    parser = argparse.ArgumentParser(prog="fsdp-recipes estimate", description=estimator.__doc__.splitlines()[0])
    add_estimate_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_estimate(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
