"""How long the launcher takes to bring a job down after one rank is SIGKILLed (a lost node, an OOM kill).

    python benchmarks/fault_stop_time.py [--trials 3] [--num-processes 2]

Runs the SFT recipe on the demo data with `FSDP_RECIPES_FAULT=kill-after-step:5@1` and reports, per trial, the
seconds between the kill and the launcher's exit, and its exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_trial(num_processes: int, workdir: Path) -> dict:
    output_dir = workdir / f"run-{time.time_ns()}"
    command = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"),
        "--num_processes",
        str(num_processes),
        str(REPO / "recipes" / "sft.py"),
        "--config",
        str(REPO / "recipes" / "configs" / "sft" / "demo_reverse.yaml"),
        "--output_dir",
        str(output_dir),
        "--exact_match_eval_samples",
        "0",
        "--save_steps",
        "null",
        "--report_to",
        "none",
        "--max_steps",
        "100",
    ]
    env = {**os.environ, "FSDP_RECIPES_FAULT": "kill-after-step:5@1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    exited = time.time()
    killed = float(re.search(r"FAULT: SIGKILL to rank 1 at ([0-9.]+)", result.stderr).group(1))
    return {"exit_status": result.returncode, "seconds_to_stop": round(exited - killed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--num-processes", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        trials = [one_trial(args.num_processes, Path(workdir)) for _ in range(args.trials)]
    print(
        json.dumps(
            {
                "num_processes": args.num_processes,
                "trials": trials,
                "max_seconds_to_stop": max(t["seconds_to_stop"] for t in trials),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
