"""Why a checkpoint save failed, when the disk or the quota is full: the cause found in the error's chain (causes,
contexts, and the per-rank failures DCP collects), and one DiskFullError saying how much room there is, how much a
checkpoint needs and how to go on."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from accelerate import Accelerator
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_recipes.common.errors import DiskFullError

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")  # safetensors' errors carry the errno as text
# torch.save to a path writes through C++ (inline_container.cc), whose errors on a full disk carry no errno.
_TORCH_WRITE_FAILED = ("file write failed", "unexpected pos", "iostream error")


def disk_full_cause(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain (causes, contexts, and the per-rank failures DCP collects) that says the disk or
    the quota is full, or None."""
    chain = list(_error_chain(error))
    for seen in chain:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE_ERRNOS:
            return seen
    return next((seen for seen in chain if any(text in str(seen) for text in _NO_SPACE_TEXTS)), None)


def _error_chain(error: BaseException) -> Iterator[BaseException]:
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]


def disk_full_error(
    accelerator: Accelerator, error: BaseException, *, root: Path, staging: Path, previous: Path | None, step_name: str
) -> DiskFullError | None:
    """A DiskFullError for a save into `staging` (under the checkpoints folder `root`; `previous`: the latest complete
    checkpoint) that failed for lack of space, the partial save removed; None for any other failure."""
    cause = disk_full_cause(error)
    if cause is None and not any(text in str(seen) for seen in _error_chain(error) for text in _TORCH_WRITE_FAILED):
        return None
    if previous is not None:
        need = _bytes_under(previous)
        need_text = f"the previous checkpoint, {previous.name}, takes {_size(need)}"
    else:
        parameters = sum(p.numel() for model in getattr(accelerator, "_models", []) for p in model.parameters())
        need = max(12 * parameters, _bytes_under(staging))
        need_text = (
            f"a checkpoint of these {parameters} parameters needs about {_size(need)} (fp32 weights and AdamW's two "
            "moments)"
        )
    if cause is None:
        if shutil.disk_usage(root).free >= need:  # a failed write with room to spare is some other failure
            return None
        reason = "torch could not write the file"
    elif isinstance(cause, OSError) and cause.errno in _NO_SPACE_ERRNOS:
        reason = os.strerror(cause.errno)
    else:
        reason = next(text for text in _NO_SPACE_TEXTS if text in str(cause))
    # Another rank may still be writing into the staging folder; the main process removes it (the next save would).
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    resume = (
        f" {previous.name} is still the latest complete checkpoint: --resume_from_checkpoint latest continues from it."
        if previous is not None
        else ""
    )
    return DiskFullError(
        f"the disk is full: saving checkpoint {step_name} in {root} failed ({reason}). "
        f"{_size(shutil.disk_usage(root).free)} free there now; {need_text}. Free space on that disk, keep fewer "
        "checkpoints (save_total_limit), or choose an output_dir on a disk with room." + resume,
        reported_by_main_rank=any(isinstance(seen, CheckpointException) for seen in _error_chain(error)),
    )


def _bytes_under(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def _size(count: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"
