"""When a periodic component acts: every N optimizer steps and at the last one. Logging, evaluation and checkpoints
each hold a `Cadence`, so "every N steps or the last step" is written once."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Due at every multiple of `every` and at `total_steps`. `every=None`: only at the last step, or never with
    `at_last_step=False` (a checkpointer whose `save_steps` is null)."""

    every: int | None
    total_steps: int
    at_last_step: bool = True

    def due(self, step: int) -> bool:
        if self.every is not None and step % self.every == 0:
            return True
        return self.at_last_step and step == self.total_steps
