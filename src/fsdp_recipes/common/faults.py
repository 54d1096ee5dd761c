"""Deliberate faults, for rehearsing preemption and crashes (used by the tests, usable by anyone).

Set `FSDP_RECIPES_FAULT` to `<action>-<point>:<step>[@<rank>]`, e.g.

    kill-after-step:6        every rank SIGKILLs itself right after optimizer step 6 (a preempted job)
    kill-after-step:6@1      only rank 1 dies (a lost node); the launcher must bring the others down
    kill-during-save:8       die after the shards of step 8's checkpoint are written, before it is committed
    raise-after-step:4@1     rank 1 raises an exception (a bad batch)
    nan-before-step:3        step 3's gradients are made NaN before the optimizer sees them (a numeric blow-up)
    term-after-step:4@1      rank 1 gets SIGTERM after step 4 (a preemption notice reaching one rank first)
    pause-before-step:3      every rank waits before step 3's update until the file FSDP_RECIPES_FAULT_RELEASE names
                             exists, having written <that file>.paused-<rank>: time to break something the run
                             depends on (stop the vLLM server) at a known step

Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

FAULT_ENV = "FSDP_RECIPES_FAULT"
RELEASE_ENV = "FSDP_RECIPES_FAULT_RELEASE"
PAUSE_LIMIT_S = 300.0  # a paused rank goes on by itself after this: a forgotten release does not hang a job


class InjectedFault(RuntimeError):
    deliberate = True  # not a bug: the error boundary does not ask for a report


def inject_fault(point: str, step: int, rank: int) -> bool:
    """Acts on FSDP_RECIPES_FAULT at `point`; True when the caller is to make this step's values not finite."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    action_point, _, where = spec.partition(":")
    action, _, fault_point = action_point.partition("-")
    at_step, _, at_rank = where.partition("@")
    if fault_point != point or int(at_step) != step or (at_rank and int(at_rank) != rank):
        return False
    if action == "kill":
        # The time lets a test measure how long the launcher takes to bring the other ranks down.
        print(f"FAULT: SIGKILL to rank {rank} at {time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if action == "pause":
        release = Path(os.environ[RELEASE_ENV])
        Path(f"{release}.paused-{rank}").touch()
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if action == "raise":
        raise InjectedFault(f"injected fault on rank {rank} after step {step} ({FAULT_ENV}={spec})")
    return action == "nan"
