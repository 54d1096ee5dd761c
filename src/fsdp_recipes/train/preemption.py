"""Preemption: a signal that the job is about to be stopped (SLURM's `--signal`, a spot instance's notice, torchrun
passing on SIGTERM) makes every rank finish the optimizer step it is in, save one checkpoint together, and stop with
`PREEMPTED_EXIT_CODE`. The next start of the same command in the same output_dir resumes from it by itself, as does a
launcher's restart after a crash (`accelerate launch --max_restarts N`, a requeued SLURM job). docs/runs.md."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.train.checkpoint import CHECKPOINTS, latest_checkpoint

MARKER = "PREEMPTED"  # in output_dir/checkpoints: the checkpoint a preempted run saved; removed when a run finishes
# The launchers' restart counts: > 0 when this start is a restart of one that failed or was requeued.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def check_signal_names(name: str, values: list[str]) -> str | None:
    unknown = [value for value in values if not isinstance(getattr(signal, str(value), None), signal.Signals)]
    if unknown:
        return f"{name} names {', '.join(map(repr, unknown))}, not signals (e.g. SIGTERM, SIGUSR1, SIGUSR2)"
    if "SIGKILL" in values or "SIGSTOP" in values:
        return f"{name}: SIGKILL and SIGSTOP cannot be caught; a run cannot save on them"
    return None


class PreemptionWatch:
    """Notes the first of `signal_names` that arrives (a second one, during the save, changes nothing) and restores
    the previous handlers on `close`. `requested` is collective: true on every rank once any rank got a signal."""

    def __init__(self, signal_names: list[str]):
        self.received: str | None = None
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python lets only the main thread set handlers: a run driven from another thread keeps the defaults
        for name in signal_names:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._note)

    def _note(self, number: int, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(number).name
            print(
                f"{self.received} received: finishing this optimizer step, then every rank saves a checkpoint",
                file=sys.stderr,
                flush=True,
            )

    def requested(self, accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.received is not None
        # one small all-reduce (and a host sync) per step, so that every rank stops at the same step
        flag = torch.tensor([self.received is not None], dtype=torch.int32, device=accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def mark_preempted(output_dir: str | Path, checkpoint: Path, *, why: str = "preempted") -> None:
    """The next start of the same command resumes from `checkpoint`; `why` the run stopped, for its message."""
    reason = "" if why == "preempted" else f"{why}\n"
    (Path(output_dir) / CHECKPOINTS / MARKER).write_text(f"{checkpoint.name}\n{reason}")


def clear_mark(output_dir: str | Path) -> None:
    (Path(output_dir) / CHECKPOINTS / MARKER).unlink(missing_ok=True)


def automatic_resume(output_dir: str | Path) -> str | None:
    """Why this start resumes from the latest checkpoint although resume_from_checkpoint is unset, or None: the run
    in output_dir was preempted, or the launcher restarts a run that failed or was requeued."""
    latest = latest_checkpoint(output_dir)
    marker = Path(output_dir) / CHECKPOINTS / MARKER
    lines = marker.read_text().splitlines() if marker.is_file() else []
    saved = lines[0].strip() if lines else None
    why = lines[1].strip() if len(lines) > 1 else "preempted"
    if saved and not (Path(output_dir) / CHECKPOINTS / saved).is_dir():
        if latest is None:  # starting over in place would write a new run over the preempted one's folder
            raise ConfigError(
                f"the run in {output_dir} was preempted and saved {saved}, which is no longer in {CHECKPOINTS}/ (and "
                f"{CHECKPOINTS}/latest names no checkpoint that is there): restore it to resume, set "
                f"resume_from_checkpoint to an older checkpoint folder, or remove {CHECKPOINTS}/{MARKER} (or choose "
                "another output_dir) to start the run over"
            )
        return (
            f"the run in {output_dir} was preempted, but the checkpoint it saved ({saved}) is gone: resuming from "
            f"{latest.name}, the latest left (the steps after it are trained again)"
        )
    if latest is None:
        return None
    if saved is not None:
        return f"the run in {output_dir} was {why}: resuming from {latest.name}"
    for variable in RESTART_COUNTS:
        if os.environ.get(variable, "0") not in ("", "0"):
            return f"this is restart {os.environ[variable]} of the job ({variable}): resuming from {latest.name}"
    return None
