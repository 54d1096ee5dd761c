"""Generation from an FSDP2-sharded policy: weights gathered once for the pass (`generation.weights_gathered`, the GRPO
recipe's default) against gathered by every forward (once per decoded token), on the same prompts (docs/grpo.md).

    accelerate launch --config_file accelerate_configs/fsdp_2proc_cpu.yaml benchmarks/grpo_generation_fsdp.py \
        --model outputs/demo_reverse_partial

Each rank generates 128 completions (16 prompts x 8) of at most 12 tokens, 32 per `generate` call, with the recipe's
`generate_completions`; the median of 3 timed passes after a warm-up pass each way. The completions must be identical
both ways (same weights, same seeded noise). Prints one JSON object on the main process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[1] / "demo" / "assets" / "reverse_prompts" / "test.jsonl"


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.distributed.accelerator import build_accelerator
    from fsdp_recipes.methods.grpo.prompts import tokenize_prompt
    from fsdp_recipes.train import generation

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args()
    accelerator, _parallel = build_accelerator()  # FSDP2 over gloo on CPU, as the recipes
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    start = 16 * accelerator.process_index
    ids = [tokenize_prompt(row["prompt"], tokenizer) for row in rows[start : start + 16] for _ in range(8)]
    keys = list(range(len(ids)))
    settings = generation.GenerationSettings(args.max_new_tokens, batch_size=32, seed=0)
    results, outputs = {}, {}
    for gathered in (True, False):
        name = "gathered_once_per_pass" if gathered else "gathered_per_forward"
        rates = []
        for repeat in range(4):
            started = time.perf_counter()
            with generation.weights_gathered(model, enabled=gathered):
                completions, _ = generation.generate_completions(
                    model, tokenizer, ids, keys, settings, synced_gpus=accelerator.num_processes > 1
                )
            seconds = time.perf_counter() - started
            if repeat:
                rates.append(sum(map(len, completions)) * accelerator.num_processes / seconds)
        outputs[name] = completions
        results[f"{name}_tokens_per_second"] = statistics.median(rates)
    results["speedup"] = (
        results["gathered_once_per_pass_tokens_per_second"] / results["gathered_per_forward_tokens_per_second"]
    )
    results["same_completions"] = outputs["gathered_once_per_pass"] == outputs["gathered_per_forward"]
    results["processes"] = accelerator.num_processes
    if accelerator.is_main_process:
        print(json.dumps(results, indent=2))
    accelerator.end_training()


if __name__ == "__main__":
    main()
