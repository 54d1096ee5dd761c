"""A recipe in this process: its module (recipes are scripts, not a package), its `main` run as `python
recipes/<recipe>.py` runs it, or refused with its one `error:` line; its config written as YAML, the values every
recipe test starts from, and the metrics a run logged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from helpers.paths import REPO, TOKENIZER


def load_recipe(name: str):
    """recipes/<name>.py as a module, for its config class and `main` (recipes are scripts, not a package)."""
    import importlib.util

    module_name = f"recipe_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the class is being built
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def run_recipe_in_process(recipe: str, tmp: Path, name: str, values: dict) -> None:
    """recipes/<recipe>.py's main on this one process (no launcher, no FSDP), as `python recipes/<recipe>.py` runs it."""
    run_recipe_main(recipe, ["--config", str(recipe_config(tmp / f"{name}.yaml", **values))])


def run_recipe_main(recipe: str, argv: list[str]) -> None:
    """recipes/<recipe>.py's main with these command-line arguments, on this one process, as `python
    recipes/<recipe>.py ARGV` runs it (a user error exits 2 with its one line)."""
    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.errors import exit_on_user_error

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        exit_on_user_error(lambda: load_recipe(recipe).main(list(argv)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def recipe_error_in_process(recipe: str, tmp: Path, values: dict, capsys, extra_argv: tuple[str, ...] = ()) -> str:
    """recipes/<recipe>.py's main in this process, under the same wrapper as `python recipes/<recipe>.py`, with a
    config that must be refused before weights load: returns its one `error:` line (exit 2, no traceback). The checks
    before loading need no processes, so this costs well under a second instead of a ~15 s launch."""
    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.errors import exit_on_user_error

    config = recipe_config(tmp / "recipe.yaml", **values)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: load_recipe(recipe).main(["--config", str(config), *extra_argv]))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    return errors[0]


def recipe_config(path: Path, **values) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def base_recipe_values(tiny_model_config: Path, chat_data: Path, output_dir: Path, **overrides) -> dict:
    values = dict(
        model_config=str(tiny_model_config),
        tokenizer_name_or_path=str(TOKENIZER),
        dataset_name=str(chat_data),
        max_length=64,
        max_steps=10,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        output_dir=str(output_dir),
        seed=7,
        report_to="none",  # the tracker costs every launch an import; the reference run turns it on and checks it
    )
    values.update(overrides)
    return values


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def launch_environment_of(accelerate_config: Path, *, mixed_precision: str | None = None) -> dict[str, str]:
    """What `accelerate launch --config_file ACCELERATE_CONFIG --num_processes 1` exports to its one process (computed
    with the launcher's own code), plus torchrun's rank variables: a launch of one process, in this one. An HSDP mesh
    needs 2 processes or more, so its sizes are dropped: one process is plain FSDP2 with the config's settings."""
    import yaml as yaml_module

    from fsdp_recipes.distributed.launch_checks import exported_environment
    from helpers.launch import free_port

    environment = exported_environment(accelerate_config)
    declared = yaml_module.safe_load(accelerate_config.read_text()).get("mixed_precision", "no")
    environment["ACCELERATE_MIXED_PRECISION"] = mixed_precision or environment.get(
        "ACCELERATE_MIXED_PRECISION", declared
    )
    for key in [key for key in environment if key.startswith("PARALLELISM_CONFIG_")]:
        del environment[key]
    environment.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    environment.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
    )  # fmt: skip
    return environment


def run_recipe_launched_here(
    recipe: str, tmp: Path, name: str, values: dict, accelerate_config: Path, *, mixed_precision: str | None = None
) -> None:
    """recipes/<recipe>.py's main in this process as a 1-process `accelerate launch` of `accelerate_config` runs it:
    its FSDP settings and mixed precision, FSDP2 over a 1-rank gloo group (so accelerate's wrapping and FSDP's
    mixed-precision policy are what a GPU launch gets), at a cost of seconds instead of a ~15 s launch."""
    import os

    import torch.distributed as dist

    saved = dict(os.environ)
    os.environ.update(launch_environment_of(accelerate_config, mixed_precision=mixed_precision))
    try:
        run_recipe_in_process(recipe, tmp, name, values)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
