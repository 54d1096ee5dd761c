"""What LoRA and each DPO reference mode cost, measured on real 2-process FSDP2 runs of the recipes on one small model.

    python benchmarks/lora_and_dpo_costs.py            # ~4 minutes on 2 CPU cores
    python benchmarks/lora_and_dpo_costs.py --json     # one JSON object instead of the table
    python benchmarks/lora_and_dpo_costs.py --device-config accelerate_configs/fsdp_8gpu.yaml --num-processes 8
    python benchmarks/lora_and_dpo_costs.py --runs "dpo model" "dpo precomputed" simpo orpo "kto model"

Runs, each `accelerate launch`ed with the Accelerate config given (default: the 2-process CPU FSDP2 config):

  sft full            recipes/sft.py, every parameter trained
  sft lora            the same with use_peft (rank 16 on every linear layer of the decoder blocks)
  dpo model           recipes/dpo.py, the reference a frozen copy sharded like the policy
  dpo precomputed     the reference's values computed before the first step (no reference model afterwards)
  dpo lora            use_peft: the reference is the policy with its adapters off
  simpo, orpo         recipes/dpo.py with loss_type simpo / orpo: no reference model, no precompute pass
  kto model           recipes/kto.py on the same pairs unpaired, the reference a sharded frozen copy

on a Llama of 4.8M parameters (hidden 256, 6 layers, the demo's character tokenizer), initialised once with a fixed seed
and saved, for `--steps` optimizer steps on the demo's reversal data (SFT) and preference pairs (DPO). Reported per
run, from its own records: the state each rank holds after the first step (parameters, gradients, AdamW state, from
`run_summary.json`, with the reference copy's shard where the recipe reports it, else the estimator's line), the
peak memory of the process (CPU: the resident-set peak, so it includes the Python runtime), and tokens per second
per device, mean of the logged windows after the first (`metrics.jsonl`; for DPO the tokens of chosen and rejected
rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "assets"
CPU_CONFIG = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
LORA = dict(use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.0)
RUNS = {
    "sft full": ("sft", {}),
    "sft lora": ("sft", LORA),
    "dpo model": ("dpo", {}),
    "dpo precomputed": ("dpo", {"precompute_ref_log_probs": True}),
    "dpo lora": ("dpo", LORA),
    "simpo": ("dpo", {"loss_type": "simpo", "beta": 2.0}),
    "orpo": ("dpo", {"loss_type": "orpo"}),
    "kto model": ("kto", {}),
}


def make_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(name: str, recipe: str, overrides: dict, model: Path, work: Path, args) -> dict:
    out = work / name.replace(" ", "_")
    values = dict(
        model_name_or_path=str(model),
        output_dir=str(out),
        max_length=64,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-4,
        logging_steps=max(1, args.steps // 6),
        save_steps=None,
        eval_split_size=0,
        dataset_test_split=None,
        report_to="none",
        seed=0,
        dataset_name=str(DEMO / ("reverse" if recipe == "sft" else "reverse_preferences")),
    )
    if recipe == "sft":
        values["packing"] = False  # one example per row, as DPO's rows: the same work per token
    values.update(overrides)
    config = work / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(values))
    command = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--config_file",
        str(args.device_config),
        "--num_processes",
        str(args.num_processes),
        str(REPO / "recipes" / f"{recipe}.py"),
        "--config",
        str(config),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "run_summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "tokens_per_second_per_device" in r and not r.get("warmup")]
    state = summary["state_bytes_per_rank"][0]
    return {
        "run": name,
        "trainable_parameters": summary["trainable_parameters"],
        "total_parameters": summary["total_parameters"],
        "rank0_state_mib": {key: round(value / 2**20, 2) for key, value in state.items()},
        "rank0_state_total_mib": round(sum(state.values()) / 2**20, 2),
        "reference_model_mib": round(state["reference_model"] / 2**20, 2) if "reference_model" in state else None,
        "estimated_reference_model_mib": round(
            summary["memory_estimate"]["predicted_per_gpu_bytes"].get("reference_model", 0) / 2**20, 2
        ),
        "peak_memory_gib_max": max(
            (max(r["peak_memory_gib_per_rank"]) for r in records if r.get("peak_memory_gib_per_rank")), default=None
        ),
        "tokens_per_second_per_device": round(sum(r["tokens_per_second_per_device"] for r in windows) / len(windows), 1)
        if windows
        else None,
        "reference": summary.get("reference"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device-config", type=Path, default=CPU_CONFIG)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        model = make_model(work / "model")
        rows = [run(name, *RUNS[name], model, work, args) for name in args.runs]
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{'run':<16} {'trainable':>11} {'rank-0 state MiB (params/grads/AdamW)':>40} {'ref. copy MiB':>13} "
        f"{'peak GiB':>9} {'tokens/s/device':>16}"
    )
    for row in rows:
        state = row["rank0_state_mib"]
        reference = row["reference_model_mib"]
        parts = f"{state['parameters']:.2f} / {state['gradients']:.2f} / {state['optimizer_state']:.2f}"
        print(
            f"{row['run']:<16} {row['trainable_parameters']:>11,} {parts:>40} {reference if reference is not None else row['estimated_reference_model_mib']:>13.2f} "
            f"{row['peak_memory_gib_max'] or 0:>9.3f} {row['tokens_per_second_per_device'] or 0:>16.1f}"
        )


if __name__ == "__main__":
    main()
