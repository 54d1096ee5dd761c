"""Collectives every recipe needs: a step run on all ranks that fails on all of them together, sums and values
gathered over ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from fsdp_recipes.common.errors import UserError

T = TypeVar("T")


def on_every_rank_together(accelerator: Accelerator, step: Callable[[], T], *, main_process_first: bool = False) -> T:
    """Runs `step` on every rank (the main process first, e.g. to fill the datasets cache, if asked); if it fails on
    any rank, it fails on every rank, with the failing rank's message. Without this, one rank raising while the others
    enter the next collective leaves them waiting until the collective timeout (30 minutes by default)."""
    result, failure = None, None
    context = accelerator.main_process_first() if main_process_first else contextlib.nullcontext()
    with context:
        try:
            result = step()
        except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
            failure = error
    message = f"{type(failure).__name__}: {failure}" if failure is not None else None
    messages = gather_object([message]) if accelerator.num_processes > 1 else [message]
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, text in enumerate(messages) if text]
    if failed:
        rank, text = failed[0]
        raise PeerRankFailed(f"rank {rank} failed: {text}")
    return result

class PeerRankFailed(UserError):
    """Another rank failed; this one stops with it instead of waiting in a collective."""

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
