"""Several recipes, one after another, in the processes of one `accelerate launch`: what a launch per recipe would
run, with the processes' start-up (most of a CPU launch's cost) paid once. Arguments: RECIPE CONFIG pairs. Between
recipes accelerate's shared state is reset, so each recipe builds its accelerator as in a fresh launch; the process
group stays: each recipe's `accelerator.end_training()` would destroy it, and forming it again on the launcher's store
races (a rank can hang in the rendezvous), so that is made a no-op until the last recipe has run. A recipe that fails
stops the script (its traceback, a nonzero exit). `grpo+scripted_tools` runs GRPO with the scripted tool-calling policy
of tests/helpers/scripted_tools.py (the model's own generation runs, then its tokens are replaced);
`grpo+scripted_tools_mixed` with the policy that answers some prompts without the tool. `RECIPE@NAME=VALUE,...` runs
the recipe with those launch variables changed (another layout over the same processes, e.g.
`pretrain@PARALLELISM_CONFIG_SP_SIZE=4,PARALLELISM_CONFIG_DP_SHARD_SIZE=1`), restored after it. `check:NAME OUTPUT`
runs tests/helpers/NAME.py's `main(OUTPUT)` in the launch's processes instead of a recipe."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from helpers.recipes import load_recipe  # noqa: E402


def main(argv: list[str]) -> None:
    if len(argv) % 2:
        raise SystemExit("usage: recipes_in_sequence.py RECIPE CONFIG [RECIPE CONFIG ...]")
    PartialState.destroy_process_group = lambda self, group=None: None
    for recipe, config in zip(argv[::2], argv[1::2]):
        recipe, _, layout = recipe.partition("@")
        recipe, _, option = recipe.partition("+")
        if option.startswith("scripted_tools"):
            from helpers.scripted_tools import scripted_generation

            context = scripted_generation(direct_on_short=option == "scripted_tools_mixed")
        else:
            context = contextlib.nullcontext()
        changed = dict(pair.split("=", 1) for pair in layout.split(",")) if layout else {}
        saved = {name: os.environ.get(name) for name in changed}
        os.environ.update(changed)
        try:
            with context:
                if recipe.startswith("check:"):  # a check of tests/helpers run in the launch: main(its output file)
                    importlib.import_module(f"helpers.{recipe.removeprefix('check:')}").main(config)
                else:
                    load_recipe(recipe).main(["--config", config])
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if dist.is_initialized():
            dist.barrier()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
