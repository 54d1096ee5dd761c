"""The distillation demo against plain SFT of the same student for the same steps: held-out exact match of each.

    python benchmarks/distill_vs_sft.py [--max_steps 300] [--json]

Needs the SFT demo's model at outputs/demo_reverse/latest (the teacher; `make demo` writes it). Runs, one process each
(no launcher), recipes/distill.py with recipes/configs/distill/demo_reverse.yaml, and recipes/sft.py with the same
student, data, steps, batch, schedule and seed (kd_ratio 0 in effect), each into a folder under --work_dir, then
prints the exact match of the 200 held-out strings after training for both. One process sees the 2-process global batch
(per_device_train_batch_size doubled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "distill" / "demo_reverse.yaml"
DISTILL_ONLY = ("teacher_model_name_or_path", "kd_ratio", "temperature", "kd_loss")


def run(recipe: str, config: Path, output_dir: Path) -> float:
    command = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--config", str(config)]
    command += ["--output_dir", str(output_dir), "--report_to", "none", "--overwrite_output_dir", "true"]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return json.loads((output_dir / "eval_results.json").read_text())["exact_match_after"]


def main() -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=None, help="default: the demo config's")
    parser.add_argument("--work_dir", default=str(REPO / "outputs" / "distill_vs_sft"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    values = yaml.safe_load(CONFIG.read_text())
    values["per_device_train_batch_size"] *= 2  # one process: the demo's 2-process global batch
    if args.max_steps:
        values["max_steps"] = args.max_steps
    configs = {}
    for recipe in ("distill", "sft"):
        chosen = values if recipe == "distill" else {k: v for k, v in values.items() if k not in DISTILL_ONLY}
        configs[recipe] = work / f"{recipe}.yaml"
        configs[recipe].write_text(yaml.safe_dump(chosen))
    results = {recipe: run(recipe, configs[recipe], work / recipe) for recipe in ("distill", "sft")}
    report = {"max_steps": values["max_steps"], "exact_match_after": results}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"held-out exact match after {values['max_steps']} steps (200 strings, greedy):")
        for recipe, value in results.items():
            print(f"  {'distilled' if recipe == 'distill' else 'plain SFT'}: {value:.1%}")


if __name__ == "__main__":
    main()
