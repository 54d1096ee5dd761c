"""Collectives every recipe needs: a step run on all ranks that fails on all of them together, sums and values
gathered over ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import PeerRankFailed, UserError

T = TypeVar("T")

__all__ = ["PeerRankFailed", "on_every_rank_together", "sum_over_ranks", "values_of_all_ranks"]


def on_every_rank_together(
    accelerator: Accelerator, step: Callable[[], T], *, main_process_first: bool = False, what: str | None = None
) -> T:
    """Runs `step` on every rank (the main process first, e.g. to fill the datasets cache, if asked); if it fails on
    any rank, it fails on every rank, with the failing rank's message. Without this, one rank raising while the others
    enter the next collective leaves them waiting until the collective timeout (30 minutes by default).

    `what` names the step (`fsdp_recipes.common.steps`): a library's exception caused by the user's input becomes one
    error naming it. Any other exception is a bug: the lowest rank that hit it re-raises it (one traceback), every
    other rank stops with one line saying which rank failed."""
    result, failure = None, None
    context = accelerator.main_process_first() if main_process_first else contextlib.nullcontext()
    with context:
        try:
            with steps.step(what) if what else contextlib.nullcontext():
                result = step()
        except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
            failure = error
    report = None if failure is None else _report(failure)
    reports = gather_object([report]) if accelerator.num_processes > 1 else [report]
    failed = {rank: report for rank, report in enumerate(reports) if report}
    if not failed:
        return result
    bugs = [rank for rank, (kind, _) in failed.items() if kind == "bug"]
    if failure is not None and (report[0] != "bug" or bugs[0] == accelerator.process_index):
        raise failure  # a user error (printed once, by the main rank), or the bug's one traceback, or a peer's bug
    if bugs or any(kind == "peer-bug" for kind, _ in failed.values()):
        culprit = f"rank {bugs[0]}" if bugs else "another rank"
        raise PeerRankFailed(f"{culprit} failed with an unexpected error (a bug: its traceback is above)", bug=True)
    rank = min(failed)
    raise PeerRankFailed(f"rank {rank} failed: {failed[rank][1]}")


def _report(failure: Exception) -> tuple[str, str]:
    """(kind, message) of a rank's failure for the others: "user" (a UserError), "bug" (any other exception), or
    "peer-bug" (this rank stopped for another's bug, in a nested step)."""
    if not isinstance(failure, UserError):
        return "bug", f"{type(failure).__name__}: {failure}"
    return ("peer-bug" if getattr(failure, "bug", False) else "user"), str(failure)


def sum_over_ranks(accelerator: Accelerator, value: float | int) -> float:
    """Collective: the sum of `value` over all ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(float(value), dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, reduction="sum")) if accelerator.num_processes > 1 else float(tensor)


def values_of_all_ranks(accelerator: Accelerator, value: float) -> list[float]:
    """Collective: `value` from every rank, in rank order."""
    if accelerator.num_processes == 1:
        return [float(value)]
    gathered = accelerator.gather(torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device))
    return [float(v) for v in gathered]
