"""The GRPO demo's figures (docs/grpo.md): held-out greedy exact match before and after, the step-time breakdown of
the run, and the recipe's generation speed against a bare `model.generate` on the same model and prompts.

    python benchmarks/grpo_demo.py --before outputs/demo_reverse_partial --after outputs/demo_reverse_grpo/latest

- exact match: greedy decoding (no sampling) of each of the first --held-out prompts of
  demo/assets/reverse_prompts/test.jsonl (never trained on), the completion compared with `answer`;
- step time: the means over the run's logged steps (warm-up left out) of `time/generation_share`,
  `time/scoring_share`, `time/training_share`, and `tokens/generated_per_second`, from --after's metrics.jsonl;
- generation speed: `generation.generate_completions` (the recipe's generation step: per-slot seeded sampling) against
  `model.generate(do_sample=True)` on an unsharded copy of --before, the same 64 prompts x 8 generations, batches of
  --batch-size, max_completion_length tokens, in one process: after a warm-up pass each, 7 rounds of one timed pass
  each, alternated so that the shared machine's changing load hits both alike; the ratio is the median of the rounds'
  ratios (with their range). --continuous-batching also times transformers' `generate_batch` (continuous batching,
  sampling, the same prompts) once after a warm-up pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[1] / "demo" / "assets" / "reverse_prompts" / "test.jsonl"


DEVICE, DTYPE = "cpu", "float32"  # --device, --dtype


def load(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, DTYPE)).to(DEVICE)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    from fsdp_recipes.methods.grpo.prompts import tokenize_prompt

    return [tokenize_prompt(row["prompt"], tokenizer) for row in rows]


@torch.no_grad()
def greedy_exact_match(folder: str, rows: list[dict], max_new_tokens: int) -> float:
    model, tokenizer = load(folder)
    tokenizer.padding_side = "left"
    hits = 0
    ids = prompt_ids(tokenizer, rows)
    for start in range(0, len(rows), 50):
        batch = tokenizer.pad({"input_ids": ids[start : start + 50]}, return_tensors="pt").to(DEVICE)
        output = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum(t.strip() == row["answer"] for t, row in zip(texts, rows[start : start + 50]))
    return hits / len(rows)


def step_breakdown(folder: str) -> dict:
    records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and not r.get("warmup")]
    keys = ("time/generation_share", "time/scoring_share", "time/training_share", "tokens/generated_per_second")
    means = {key: statistics.mean(r[key] for r in steps if key in r) for key in keys}
    means["step_time_s"] = statistics.mean(r["step_time_s"] for r in steps)
    means["steps"] = len(steps)
    return means


@torch.no_grad()
def generation_speed(
    folder: str,
    rows: list[dict],
    *,
    max_tokens: int,
    batch_size: int,
    rounds: int = 7,
    continuous_batching: bool = False,
) -> dict:
    from fsdp_recipes.train import generation

    model, tokenizer = load(folder)
    ids = [p for p in prompt_ids(tokenizer, rows[:64]) for _ in range(8)]
    keys = list(range(len(ids)))
    settings = generation.GenerationSettings(max_tokens, batch_size=batch_size, seed=0)

    def recipe():
        completions, _ = generation.generate_completions(model, tokenizer, ids, keys, settings, synced_gpus=False)
        return sum(map(len, completions))

    def bare():
        tokenizer.padding_side = "left"
        tokens = 0
        for start in range(0, len(ids), batch_size):
            batch = tokenizer.pad({"input_ids": ids[start : start + batch_size]}, return_tensors="pt").to(DEVICE)
            output = model.generate(
                **batch, max_new_tokens=max_tokens, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id
            )
            generated = output[:, batch["input_ids"].shape[1] :]
            tokens += int((generated != tokenizer.pad_token_id).sum())
        return tokens

    def continuous():  # transformers' continuous batching (paged KV cache, requests scheduled as slots free up)
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=True, top_k=0, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        outputs = model.generate_batch(ids, generation_config=config, progress_bar=False)
        return sum(len(output.generated_tokens) for output in outputs.values())

    # Alternated, one pass each per round, so that a change in the machine's load hits both alike; the ratio is the
    # median of the rounds' ratios.
    recipe(), bare()
    rates: dict[str, list[float]] = {"recipe": [], "bare_generate": []}
    for _ in range(rounds):
        for name, run in (("recipe", recipe), ("bare_generate", bare)):
            synchronize()
            started = time.perf_counter()
            tokens = run()
            synchronize()
            rates[name].append(tokens / (time.perf_counter() - started))
    speeds = {f"{name}_tokens_per_second": statistics.median(values) for name, values in rates.items()}
    ratios = [mine / theirs for mine, theirs in zip(rates["recipe"], rates["bare_generate"])]
    speeds["ratio"] = statistics.median(ratios)
    speeds["ratio_range"] = [min(ratios), max(ratios)]
    if continuous_batching:  # ~20x slower on CPU: one timed pass after a warm-up one
        continuous()
        started = time.perf_counter()
        tokens = continuous()
        speeds["continuous_batching_tokens_per_second"] = tokens / (time.perf_counter() - started)
    return speeds


def synchronize() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    global DEVICE, DTYPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the model GRPO started from")
    parser.add_argument("--after", help="the GRPO run's output_dir (without it: the generation speeds only)")
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--continuous-batching", action="store_true", help="also time transformers' generate_batch (minutes on CPU)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the models' dtype")
    args = parser.parse_args()
    DEVICE, DTYPE = args.device, args.dtype
    torch.manual_seed(0)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: args.held_out]
    results = {}
    if args.after:
        results = {
            "held_out_prompts": len(rows),
            "exact_match_before": greedy_exact_match(args.before, rows, args.max_new_tokens),
            "exact_match_after": greedy_exact_match(args.after, rows, args.max_new_tokens),
            "step_breakdown": step_breakdown(args.after),
        }
    results["generation"] = generation_speed(
        args.before,
        rows,
        max_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        continuous_batching=args.continuous_batching,
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
