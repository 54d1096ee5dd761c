"""The GPU kernels' packages (requirements-gpu.txt: torchao, liger-kernel, and triton, which CUDA builds of torch
bring), which `make venv` installs into .venv/kernels rather than site-packages: with torchao importable, peft imports
it in every process that applies LoRA (~6 s each). A test that needs them puts the folder on this process's path."""

from __future__ import annotations

import sys
from pathlib import Path

KERNELS = Path(sys.prefix) / "kernels"


def kernel_packages_on_path() -> None:
    if not (KERNELS / "torchao").is_dir():
        raise RuntimeError(f"{KERNELS} holds no torchao: run `make venv` (it installs requirements-gpu.txt there)")
    if str(KERNELS) not in sys.path:
        sys.path.append(str(KERNELS))
