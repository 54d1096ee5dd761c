"""The launch harness itself (tests/helpers/launch.py): a launch that outlives its timeout is killed with every
process under it, even one in a session of its own that still holds the output pipes, and the test fails instead of
blocking the suite (once, a rank of a finished DDP run stayed alive in its own session and the suite waited on it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launch import descendants, run_process_group

LINGERER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
    "time.sleep(300)"
)


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def test_a_timed_out_launch_is_killed_with_a_child_in_its_own_session_and_the_test_fails_at_once():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", LINGERER], timeout=1.5)
    assert time.monotonic() - started < 20
    lingering = [
        cmdline.parent.name for cmdline in Path("/proc").glob("[0-9]*/cmdline") if b"sleep(300)" in read(cmdline)
    ]
    assert lingering == [], lingering
    assert descendants(1)  # /proc is read: the machine's first process has children
