"""Collectives every recipe needs: a step run on all ranks that fails on all of them together, sums and values
gathered over ranks. Those over the data-parallel ranks take the run's layout (`parallel`, `Run.parallel`): the ranks
of a TP or SP group hold the same batch, and so the same values, which count once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import PeerRankFailed, UserError
from fsdp_recipes.distributed.parallel_dims import ParallelDims

T = TypeVar("T")

__all__ = [
    "PeerRankFailed",
    "gather_for_metrics",
    "gather_lists",
    "gather_tensors",
    "on_every_rank_together",
    "sum_over_ranks",
    "sum_tensor_over_ranks",
    "values_of_all_ranks",
]


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


def sum_over_ranks(accelerator: Accelerator, value: float | int, *, parallel: ParallelDims) -> float:
    """Collective: the sum of `value` over the data-parallel ranks (float64, so token counts stay exact). Under
    tensor or sequence parallelism every rank of a group holds the same batch and so the same value: the sum over all
    ranks divided by `parallel.batch_sharing_size` counts each token once."""
    return float(
        sum_tensor_over_ranks(
            accelerator, torch.tensor(float(value), dtype=torch.float64, device=accelerator.device), parallel=parallel
        )
    )


def sum_tensor_over_ranks(accelerator: Accelerator, tensor: torch.Tensor, *, parallel: ParallelDims) -> torch.Tensor:
    """Collective: `tensor` summed over the data-parallel ranks (the ranks of a TP or SP group hold the same values:
    the sum over all ranks divided by `parallel.batch_sharing_size`)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor, reduction="sum") / parallel.batch_sharing_size


def extreme_over_ranks(accelerator: Accelerator, tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """Collective: the largest (`kind` "max") or smallest ("min") of every rank's scalar `tensor`."""
    if accelerator.num_processes == 1:
        return tensor
    value = tensor.detach().to(device=accelerator.device, dtype=torch.float64).reshape(1).clone()
    op = torch.distributed.ReduceOp.MAX if kind == "max" else torch.distributed.ReduceOp.MIN
    torch.distributed.all_reduce(value, op=op)
    return value[0]


def values_of_all_ranks(accelerator: Accelerator, value: float) -> list[float]:
    """Collective: `value` from every rank, in rank order."""
    if accelerator.num_processes == 1:
        return [float(value)]
    gathered = accelerator.gather(torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device))
    return [float(v) for v in gathered]


# Under tensor (or sequence) parallelism every rank of a TP (SP) group holds the same batch and so the same values: the
# gathers below keep one copy per data-parallel rank (the first rank of each group), in data-parallel rank order.
def gather_lists(accelerator: Accelerator, values: list, *, parallel: ParallelDims) -> list:
    """Collective: every data-parallel rank's `values`, concatenated in rank order, on every rank."""
    if accelerator.num_processes == 1:
        return list(values)
    sharing = parallel.batch_sharing_size
    if sharing == 1:
        return gather_object(list(values))
    per_rank = gather_object([list(values)])
    return [value for rank, part in enumerate(per_rank) if rank % sharing == 0 for value in part]


def gather_tensors(accelerator: Accelerator, tensor: torch.Tensor, *, parallel: ParallelDims) -> torch.Tensor:
    """Collective: every data-parallel rank's `tensor` (the same shape on every rank), concatenated along dim 0."""
    if accelerator.num_processes == 1:
        return tensor
    gathered = accelerator.gather(tensor)
    sharing = parallel.batch_sharing_size
    if sharing == 1:
        return gathered
    return gathered.reshape(accelerator.num_processes, *tensor.shape)[::sharing].flatten(0, 1)


def gather_for_metrics(accelerator: Accelerator, value, *, parallel: ParallelDims, use_gather_object: bool = False):
    """`accelerator.gather_for_metrics` (one copy of every example of a prepared loader's batch, the copies padding
    an uneven last batch dropped) that also counts a TP or SP group's shared batch once."""
    if parallel.batch_sharing_size == 1:
        return accelerator.gather_for_metrics(value, use_gather_object=use_gather_object)
    if use_gather_object:
        data = gather_lists(accelerator, list(value), parallel=parallel)
    else:
        data = gather_tensors(accelerator, value, parallel=parallel)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        data = data[: state.remainder]
    return data
