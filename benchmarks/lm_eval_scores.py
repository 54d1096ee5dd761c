"""lm-evaluation-harness on a model folder three ways, with the demo's shipped tasks: recipes/eval.py on 1 and on 2 CPU
processes (FSDP2, the documents split between the ranks), and lm-eval's own CLI (`lm-eval run --model hf`, one
process); plus eval.py's own exact match on the same strings (recipes/configs/eval/demo_reverse.yaml). Prints each
score and the documents per second of each pass.

    python benchmarks/lm_eval_scores.py MODEL_FOLDER [--limit N]

MODEL_FOLDER: the SFT demo's model (`make demo`: outputs/demo_reverse/latest), or any causal LM with the demo's
tokenizer. Run from the repository root (the tasks read demo/assets/ relative to it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASKS = ["demo_reverse", "demo_first_letter"]
BATCH = 50


def eval_py(model: str, out: Path, processes: int, limit: int | None, *extra: str) -> dict:
    command = [
        str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "accelerate_configs/fsdp_2proc_cpu.yaml"),
        "--num_processes", str(processes), str(REPO / "recipes/eval.py"), "--model_name_or_path", model,
        "--output_dir", str(out), "--per_device_eval_batch_size", str(BATCH), *extra,
    ]  # fmt: skip
    if limit:
        command += ["--benchmark_limit", str(limit)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    results = json.loads((out / "eval_results.json").read_text())
    results["wall_s"] = time.perf_counter() - started
    return results


def lm_eval_cli(model: str, out: Path, limit: int | None) -> dict:
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
        "--tasks", ",".join(TASKS), "--include_path", str(REPO / "src/fsdp_recipes/train/benchmark_tasks"),
        "--apply_chat_template", "--batch_size", str(BATCH), "--device", "cpu", "--output_path", str(out),
    ]  # fmt: skip
    if limit:
        command += ["--limit", str(limit)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    (written,) = out.rglob("results_*.json")
    results = json.loads(written.read_text())
    return {"results": results["results"], "wall_s": time.perf_counter() - started, "n": results["n-samples"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tasks = ["--benchmark_tasks", *TASKS, "--benchmark_apply_chat_template", "true"]
        runs = {n: eval_py(model, tmp / f"eval_{n}", n, args.limit, *tasks) for n in (1, 2)}
        cli = lm_eval_cli(model, tmp / "cli", args.limit)
        own = eval_py(
            model, tmp / "own", 2, None, "--dataset_name", "demo/assets/reverse", "--metrics", "exact_match",
            "--max_new_tokens", "12", "--max_length", "128",
        )  # fmt: skip
    documents = sum(entry["effective"] for entry in cli["n"].values())
    counts = ", ".join(f"{task}: {cli['n'][task]['effective']}" for task in TASKS)
    print(f"{documents} documents ({counts})")
    metrics = [("demo_reverse", "exact_match"), ("demo_first_letter", "acc"), ("demo_first_letter", "acc_norm")]
    print(f"{'':32}{'eval.py 1 proc':>16}{'eval.py 2 procs':>17}{'lm-eval CLI':>13}")
    for task, metric in metrics:
        key = f"benchmark/{task}/{metric}"
        print(
            f"{task + ' ' + metric:32}{runs[1][key]:>16.4f}{runs[2][key]:>17.4f}{cli['results'][task][metric + ',none']:>13.4f}"
        )
    for n in (1, 2):
        seconds = runs[n]["benchmark_time_s"]
        print(
            f"eval.py {n} process(es): benchmark pass {seconds:.2f} s, {documents / seconds:.0f} documents/s, wall {runs[n]['wall_s']:.1f} s"
        )
    print(f"lm-eval CLI: wall {cli['wall_s']:.1f} s (start-up, model load and the pass)")
    print(f"eval.py's own exact match on the 200 strings (2 processes): {own['eval_exact_match']:.4f}")


if __name__ == "__main__":
    main()
