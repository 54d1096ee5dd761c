"""Sequence parallelism on CPU: step time and peak RSS per rank of SFT on one packed 4k-token row under SP 1, 2 and 4,
and the estimator's activation bytes beside what the row adds to each rank's peak (docs/parallelism.md).

    python benchmarks/sequence_parallel.py                     # 4,096-token rows against 256-token rows, SP 1/2/4

Each SP size is one launch of recipes/sft.py over the demo data, packed into rows of --row tokens (one row per step,
one data-parallel group: SP 1 is one process, SP n is n processes splitting the row), and one more with rows of
--baseline tokens: the difference of the two peaks is what the longer row adds to a rank, against the estimator's
activation bytes for the same difference (`tools/estimator/formulas.activation_bytes`, fp32, no checkpointing).
The model (--hidden, --layers, 8 heads, 8 KV heads) is built from a config; its step time is the median of the
logged steps after the first. Peak RSS includes Python, torch and the data (the baseline run takes that out).
Prints one JSON object after a line `== report`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SP_CONFIG = REPO / "accelerate_configs" / "fsdp2_sp2_4proc_cpu.yaml"
ONE_PROCESS = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"


def accelerate_config(folder: Path, sp: int) -> tuple[Path, int]:
    """The launch of `sp` processes splitting one row (SP 1: one plain FSDP2 process)."""
    if sp == 1:
        return ONE_PROCESS, 1
    raw = yaml.safe_load(SP_CONFIG.read_text())
    raw["num_processes"] = sp
    raw["parallelism_config"].update(parallelism_config_dp_shard_size=1, parallelism_config_sp_size=sp)
    path = folder / f"sp{sp}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, sp


def run(folder: Path, model_config: Path, sp: int, row: int, steps: int) -> dict:
    config, processes = accelerate_config(folder, sp)
    output = folder / f"sp{sp}_row{row}"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
        "--num_processes", str(processes), str(REPO / "recipes" / "sft.py"),
        "--config", str(REPO / "recipes" / "configs" / "sft" / "demo_reverse.yaml"),
        "--model_config", str(model_config), "--output_dir", str(output), "--max_length", str(row),
        "--per_device_train_batch_size", "1", "--max_steps", str(steps), "--logging_steps", "1",
        "--eval_strategy", "no", "--exact_match_eval_samples", "0", "--save_strategy", "no",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "step_time_s" in r]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in logged[1:] or logged),
        "peak_rss_gib_per_rank": max(r["peak_memory_gib_per_rank"] for r in logged[-1:]) if logged else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=4096)
    parser.add_argument("--baseline", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    from transformers import LlamaConfig

    from fsdp_recipes.tools.estimator.formulas import activation_bytes
    from fsdp_recipes.tools.estimator.shapes import load_model_info
    from fsdp_recipes.tools.estimator.workload import Workload

    folder = Path(tempfile.mkdtemp(prefix="sp_bench_"))
    model_config = folder / "config.json"
    base = json.loads((REPO / "demo" / "tiny_llama.json").read_text())
    base.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=8, num_key_value_heads=8, head_dim=args.hidden // 8,
                max_position_embeddings=max(args.row, 4096))  # fmt: skip
    LlamaConfig(**base).to_json_file(model_config)
    info = load_model_info(str(model_config))
    report = {"row": args.row, "baseline_row": args.baseline, "hidden": args.hidden, "layers": args.layers, "sp": {}}
    for sp in args.sizes:
        long, short = (
            run(folder, model_config, sp, args.row, args.steps),
            run(folder, model_config, sp, args.baseline, 2),
        )
        estimated = [
            activation_bytes(info, Workload(row_length=row, micro_batch_rows=1), 4, sp=sp)["without_checkpointing"]
            for row in (args.row, args.baseline)
        ]
        added = [a - b for a, b in zip(long["peak_rss_gib_per_rank"], short["peak_rss_gib_per_rank"])]
        report["sp"][sp] = {
            "step_time_s": round(long["step_time_s"], 3),
            "peak_rss_gib_per_rank": long["peak_rss_gib_per_rank"],
            "row_adds_gib_per_rank": [round(a, 3) for a in added],
            "estimated_activation_gib": round((estimated[0] - estimated[1]) / 2**30, 3),
        }
        print(sp, report["sp"][sp], flush=True)
    print("== report")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
