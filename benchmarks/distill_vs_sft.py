"""The distillation demo against plain SFT of the same student for the same steps: held-out exact match of each; with
`--recipes distill on_policy sft`, on-policy distillation (GKD's `lmbda`, `--lmbda` of the steps on the student's own
samples) as a third arm.

    python benchmarks/distill_vs_sft.py [--max_steps 300] [--seeds 42 43] [--set field=value ...] [--json]
    python benchmarks/distill_vs_sft.py --recipes distill on_policy sft --set packing=false --lmbda 0.5

Needs the SFT demo's model at outputs/demo_reverse/latest (the teacher; `make demo` writes it). Runs, one process each
(no launcher), recipes/distill.py with recipes/configs/distill/demo_reverse.yaml, and recipes/sft.py with the same
student, data, steps, batch, schedule and seed (the config without its teacher settings), each into a folder under
--work_dir, then prints the exact match of the 200 held-out strings after training for both, per seed, and apart for
the strings of up to 6 letters and the longer ones (the demo data cuts some of the longer answers to 6 letters), scored
again from the exported folders. One process sees the 2-process global batch (per_device_train_batch_size doubled).

--set field=value changes the config for both recipes (e.g. model_config=..., learning_rate=1e-3); distillation's own
fields (kd_ratio, temperature, kd_loss) go to distill.py alone. --recipes distill runs one side only (to try KD
settings against an SFT baseline already measured with the same student, steps and seed).
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
DISTILL_ONLY = ("teacher_model_name_or_path", "kd_ratio", "temperature", "kd_loss", "lmbda", "seq_kd")
LABELS = {"distill": "distilled", "on_policy": "on-policy distilled", "sft": "plain SFT"}


def exact_match_by_length(folder: Path, test_file: Path, longest_short: int = 6) -> dict:
    """Greedy exact match of the exported model on the held-out strings of at most `longest_short` letters and on the
    longer ones (those the demo data's cut answers are about)."""
    from grpo_demo import greedy_exact_match  # benchmarks/ is the script's folder, so on sys.path

    rows = []
    for line in test_file.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        rows.append({"prompt": [user], "answer": assistant["content"]})
    groups = {
        f"<= {longest_short} letters": [row for row in rows if len(row["answer"]) <= longest_short],
        f"> {longest_short} letters": [row for row in rows if len(row["answer"]) > longest_short],
    }
    return {name: round(greedy_exact_match(str(folder), group, 12), 4) for name, group in groups.items() if group}


def run(recipe: str, config: Path, output_dir: Path, test_file: Path) -> dict:
    command = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--config", str(config)]
    command += ["--output_dir", str(output_dir), "--report_to", "none", "--overwrite_output_dir", "true"]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "exact_match_after": json.loads((output_dir / "eval_results.json").read_text())["exact_match_after"],
        "exact_match_by_length": exact_match_by_length(output_dir, test_file),
        "eval_loss": {row["step"]: round(row["eval_loss"], 4) for row in metrics if "eval_loss" in row},
    }


def main() -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=None, help="default: the demo config's")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the demo config's seed")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="a config change (YAML value)"
    )
    parser.add_argument("--recipes", nargs="+", choices=tuple(LABELS), default=["distill", "sft"])
    parser.add_argument("--lmbda", type=float, default=0.5, help="the on_policy arm's share of on-policy steps")
    parser.add_argument("--work_dir", default=str(REPO / "outputs" / "distill_vs_sft"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    values = yaml.safe_load(CONFIG.read_text())
    values["per_device_train_batch_size"] *= 2  # one process: the demo's 2-process global batch
    if args.max_steps:
        values["max_steps"] = args.max_steps
    for change in args.set:
        field, _, value = change.partition("=")
        values[field] = yaml.safe_load(value)
    results: dict[str, dict[int, dict]] = {recipe: {} for recipe in args.recipes}
    for seed in args.seeds or [values["seed"]]:
        for recipe in args.recipes:
            chosen = {**values, "seed": seed}
            if recipe == "sft":
                chosen = {k: v for k, v in chosen.items() if k not in DISTILL_ONLY}
            if recipe == "on_policy":
                chosen["lmbda"] = args.lmbda
            config = work / f"{recipe}_seed{seed}.yaml"
            config.write_text(yaml.safe_dump(chosen))
            test_file = REPO / values["dataset_name"] / "test.jsonl"
            script = "distill" if recipe == "on_policy" else recipe
            results[recipe][seed] = run(script, config, work / f"{recipe}_seed{seed}", test_file)
    report = {"max_steps": values["max_steps"], "changes": args.set, "results": results}
    (work / "report.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"held-out exact match after {values['max_steps']} steps (200 strings, greedy){' with ' if args.set else ''}"
        f"{', '.join(args.set)}:"
    )
    for recipe, by_seed in results.items():
        figures = ", ".join(f"seed {seed}: {result['exact_match_after']:.1%}" for seed, result in by_seed.items())
        print(f"  {LABELS[recipe]}: {figures}")
        for group in next(iter(by_seed.values()))["exact_match_by_length"]:
            figures = ", ".join(f"{result['exact_match_by_length'][group]:.1%}" for result in by_seed.values())
            print(f"    strings of {group}: {figures}")


if __name__ == "__main__":
    main()
