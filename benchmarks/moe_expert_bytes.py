"""Per-rank bytes of a mixture of experts' routed-expert and dense parameters, held against estimated, under FSDP 4
and FSDP 4 x EP 4 (4 CPU processes, gloo), with the demo's tiny Qwen3-MoE (demo/tiny_qwen3_moe.json: 8 experts,
top 2). Each layout runs `recipes/sft.py` for one step; the run summary holds what each rank holds after the first
optimizer step (`state_bytes_per_rank`) beside what the estimator predicts for it (`memory_estimate`).

    python benchmarks/moe_expert_bytes.py     # ~1.5 minutes on 2 cores; prints a markdown table (docs/moe.md)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "fsdp 4": {"parallelism_config": None},
    "fsdp 4 x ep 4": {
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": 4,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 1,
            "parallelism_config_ep_size": 4,
        }
    },
}


def accelerate_config(folder: Path, name: str, changes: dict) -> Path:
    raw = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml").read_text())
    raw["num_processes"] = 4
    if changes["parallelism_config"]:
        raw["parallelism_config"] = changes["parallelism_config"]
    path = folder / f"{name.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(folder: Path, name: str, changes: dict) -> dict:
    output = folder / name.replace(" ", "_")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config(folder, name, changes)),
        str(REPO / "recipes" / "sft.py"), "--config", str(REPO / "recipes" / "configs" / "sft" / "demo_reverse_moe.yaml"),
        "--output_dir", str(output), "--max_steps", "1", "--exact_match_eval_samples", "0", "--eval_steps", "null",
        "--per_device_train_batch_size", "2",
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return json.loads((output / "run_summary.json").read_text())


def main() -> None:
    rows = [
        "| layout | rank | expert params held | estimated | dense params held (storage) | estimated |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes in LAYOUTS.items():
            summary = run(Path(tmp), name, changes)
            held, predicted = summary["state_bytes_per_rank"], summary["memory_estimate"]["rank_state_bytes_per_rank"]
            for rank, (mine, theirs) in enumerate(zip(held, predicted)):
                expert, expert_predicted = mine["routed_expert_parameters"], theirs["routed_expert_parameters"]
                dense = mine["parameters"] - expert
                dense_predicted = theirs["parameters"] - expert_predicted
                rows.append(
                    f"| {name} | {rank} | {expert:,} | {expert_predicted:,} | {dense:,} | {dense_predicted:,} |"
                )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
