"""The walk of a recipe config through the shared layer while `run.start` checks it: which modules of fsdp_recipes the
calls under `start(config)` pass through, in call order. A stay is a run of consecutive calls in one module; a return is
a stay in a module the walk had already left. Fewer returns: a start-up that asks each module once.

    python benchmarks/config_walk.py [--config recipes/configs/sft/demo_reverse.yaml] [--show]

One process, no launcher (the demo config, its model initialised from a config): it prints stays, modules, returns,
and the calls per module.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def walk(config_path: str) -> list[tuple[str, str]]:
    """(module, function) of every call into fsdp_recipes while `start` runs, in call order."""
    spec = importlib.util.spec_from_file_location("recipe_sft", REPO / "recipes" / "sft.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["recipe_sft"] = recipe
    spec.loader.exec_module(recipe)
    from fsdp_recipes import run as run_lib
    from fsdp_recipes.common import arguments

    output_dir = tempfile.mkdtemp(prefix="config_walk_")
    config = arguments.parse_config(recipe.SFTConfig, ["--config", config_path, "--output_dir", output_dir])
    calls = []
    source = str(REPO / "src" / "fsdp_recipes")

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(source):
            module = frame.f_globals.get("__name__", "?").removeprefix("fsdp_recipes.")
            calls.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run_lib.start(config, name="sft")
    finally:
        sys.setprofile(None)
    return [call for call in calls if not call[1].startswith("<")]  # comprehensions and lambdas stay with their caller


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/sft/demo_reverse.yaml"))
    parser.add_argument("--show", action="store_true", help="print every stay")
    args = parser.parse_args()
    calls = walk(args.config)
    stays = [module for index, (module, _) in enumerate(calls) if index == 0 or calls[index - 1][0] != module]
    rooms = set(stays)
    print(f"calls {len(calls)}, stays {len(stays)}, modules {len(rooms)}, returns {len(stays) - len(rooms)}")
    if args.show:
        print(" -> ".join(stays))
    for (module, function), count in sorted(collections.Counter(calls).items(), key=lambda item: -item[1])[:15]:
        print(f"  {count:4d}  {module}.{function}")


if __name__ == "__main__":
    main()
