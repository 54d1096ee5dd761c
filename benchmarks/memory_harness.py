"""What the loss-memory benchmarks share (benchmarks/chunked_loss_memory.py, distill_loss_memory.py): their common
command-line options, each mode measured in a fresh process (peak RSS is a per-process high-water mark), and one
step's peak memory and time. Imported by those scripts, which run from this folder."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable


def parser(description: str, *, rows: int) -> argparse.ArgumentParser:
    """The options every loss-memory benchmark takes: the shapes, the device, and the per-mode child's flag."""
    options = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--device", default="cpu")
    options.add_argument("--vocab", type=int, default=128_256)
    options.add_argument("--hidden", type=int, default=64)
    options.add_argument("--rows", type=int, default=rows)
    options.add_argument("--tokens", type=int, default=1024)
    options.add_argument("--chunk", type=int, default=1024)
    options.add_argument("--child", help=argparse.SUPPRESS)  # set for the fresh process that measures one mode
    options.add_argument("--json", action="store_true")
    return options


def each_mode_in_a_fresh_process(script: str, modes: tuple[str, ...]) -> dict[str, dict]:
    """{mode: what `script --child mode` printed last (JSON)}, with this command's other arguments passed on."""
    passed = [argument for argument in sys.argv[1:] if argument != "--json"]
    results = {}
    for mode in modes:
        out = subprocess.run(
            [sys.executable, script, *passed, "--child", mode], capture_output=True, text=True, check=True
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def peak_and_step_time(step: Callable[[], None], device) -> tuple[int, float]:
    """(peak bytes, median seconds of 3 steps after one warm-up) of `step` run 4 times in this process: peak allocated
    CUDA memory on a GPU, peak RSS on CPU."""
    import time

    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(4):
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(), statistics.median(times[1:])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, statistics.median(times[1:])
