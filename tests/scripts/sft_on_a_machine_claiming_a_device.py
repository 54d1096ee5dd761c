"""Runs recipes/sft.py as if this machine had an accelerator device, so that build_accelerator takes its GPU path
(plain Accelerator()). On a machine without one, a MULTI_GPU launch then degrades into independent processes, which
is exactly what the recipe's degraded-launch guard must refuse. Used by tests/test_distributed.py."""

import runpy
import sys
from pathlib import Path

import fsdp_recipes.distributed.accelerator

fsdp_recipes.distributed.accelerator.has_accelerator_device = lambda: True
sft = Path(__file__).resolve().parents[2] / "recipes" / "sft.py"
sys.argv = [str(sft), *sys.argv[1:]]
runpy.run_path(str(sft), run_name="__main__")
