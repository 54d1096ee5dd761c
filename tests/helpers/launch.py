"""Real multi-process runs: `accelerate launch` (gloo on CPU) with a timeout that kills the launcher's whole process
group, launches side by side, and a recipe launched with a config of values."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import FSDP_CPU_CONFIG, REPO
from helpers.recipes import recipe_config

ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCH_TIMEOUT_S = 240


def launch(
    script: Path | str,
    args: list[str],
    *,
    num_processes: int = 2,
    accelerate_config: Path | None = FSDP_CPU_CONFIG,
    env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
    launcher_args: list[str] = (),
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """`accelerate launch` with real processes; a hang fails the test at `timeout` instead of blocking the suite."""
    command = [str(ACCELERATE), "launch"]
    if accelerate_config is not None:
        command += ["--config_file", str(accelerate_config)]
    command += ["--num_processes", str(num_processes)]
    if num_processes > 1:
        command += ["--main_process_port", str(free_port())]
    command += [*launcher_args, str(script), *args]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_process_group(command, timeout=timeout, env=full_env, cwd=cwd)


def run_process_group(command: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO):
    """subprocess.run, but a timeout kills the launcher and every process under it: ranks left behind would keep the
    CPU busy for the rest of the suite, and one still holding the output pipes would block the suite for good."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # a rank may run in a session of its own (torch's elastic agent can start them so), out of the group's reach
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something outside the tree still holds the pipes: give up on them
            process.stdout.close()
            process.stderr.close()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def descendants(root: int) -> list[int]:
    """Every live process under `root` (children first found, then theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def concurrently(*runs):
    """Calls each of `runs` (launches) in a thread of its own and returns their results in order. A launch leaves a
    core idle a quarter of its time (start-up, rendezvous, teardown), so two at once take ~30% less than in turn."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        return [future.result() for future in futures]


def alongside(in_process, *launches):
    """Runs each of `launches` in a thread of its own while `in_process` (a recipe run in this process, which must stay
    in the main thread) runs here; returns its result and theirs. They share the cores the launches leave idle."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = [pool.submit(launch) for launch in launches]
        here = in_process()
        return here, [future.result() for future in futures]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_success(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        pytest.fail(
            f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )


def run_launched(script: Path, tmp: Path, name: str, values: dict, *, expect_success: bool = True, **launch_options):
    """A recipe under `accelerate launch` with `values` as its config (written to tmp/<name>.yaml)."""
    result = launch(script, ["--config", str(recipe_config(tmp / f"{name}.yaml", **values))], **launch_options)
    if expect_success:
        require_success(result)
    return result


def full_state_dict_config(folder: Path) -> Path:
    """The 2-process CPU FSDP2 config with FULL_STATE_DICT checkpoints (rank 0 writes the whole state)."""
    path = folder / "fsdp_full_state_dict.yaml"
    path.write_text(FSDP_CPU_CONFIG.read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT"))
    return path
