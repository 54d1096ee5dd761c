"""Host reads of tensor values made by this project's code, recorded while a recipe runs in this process. On a GPU each
read (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool`/`int`/`float` of a tensor) waits for every kernel queued
before it; on the CPU they cost nothing, so they are caught by where they are called, not by time.

A read counts when the code calling the tensor method is in `src/fsdp_recipes` or `recipes/`, and no function on the
stack is one whose job is to read values (`OFF_THE_HOT_PATH`): logging steps, generation rounds, evaluation, saves,
the run's end. Reads are grouped by the optimizer step in which they happened (`TrainingLoop.optimizer_step` ends one)."""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch

from helpers.paths import REPO

OUR_CODE = (str(REPO / "src" / "fsdp_recipes"), str(REPO / "recipes"))
# The data pipeline builds batches from host tensors, before they move to the device: its reads wait for nothing.
DATA_PIPELINE = str(REPO / "src" / "fsdp_recipes" / "data")
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# Functions that read values by design, at their own cadence or once per generation round (named by function).
OFF_THE_HOT_PATH = {
    "log_step",  # logging steps read the figures, at logging_steps
    "maybe_evaluate",
    "maybe_save",
    "save",
    "finish",
    "with_sampled_completions",  # GKD's on-policy samples: generation decodes text (GRPO's rounds: step 1 of a round)
    "_nonfinite_step",  # the error message
}
# The one read every optimizer step makes on purpose: whether the global gradient norm is finite, before the update
# (as torch's GradScaler does): a run must stop, or skip, before a NaN reaches the weights.
FINITE_GUARD = "optimizer_step"


class HostReads:
    def __init__(self):
        self.step = 1
        self.by_step: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def record(self, method: str) -> None:
        frame = sys._getframe(2)
        caller = frame.f_code.co_filename
        if not caller.startswith(OUR_CODE) or caller.startswith(DATA_PIPELINE):
            return
        where = f"{Path(caller).name}:{frame.f_lineno} {frame.f_code.co_name} .{method}"
        while frame is not None:
            if frame.f_code.co_name in OFF_THE_HOT_PATH and frame.f_code.co_filename.startswith(OUR_CODE):
                return
            if frame.f_code.co_name == FINITE_GUARD and frame.f_code.co_filename.startswith(OUR_CODE):
                where = "the finite-norm guard"
                break
            frame = frame.f_back
        self.by_step[self.step][where] += 1


@contextlib.contextmanager
def host_reads_recorded(monkeypatch):
    """Patches the tensor methods that read values to the host, and `TrainingLoop.optimizer_step` to mark each step's
    end; yields the `HostReads` record."""
    from fsdp_recipes.run import training_loop

    reads = HostReads()
    for method in READS:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            if not torch.compiler.is_compiling():
                reads.record(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    step_of = training_loop.TrainingLoop.optimizer_step

    def optimizer_step(self, step, *args, **kwargs):
        try:
            return step_of(self, step, *args, **kwargs)
        finally:
            reads.step = step + 1

    monkeypatch.setattr(training_loop.TrainingLoop, "optimizer_step", optimizer_step)
    yield reads
