"""GRPO's policy pass padded against padding-free (`padding_free: true`), on the same rollouts: step time.

    python benchmarks/grpo_padding_free.py                 # 64 completions of long-tailed lengths, 5 rounds
    python benchmarks/grpo_padding_free.py --rounds 2 --completions 16   # a smoke run

One process, a Llama of about 6M parameters built from a config (seeded), synthetic rollouts whose prompt and
completion lengths are long-tailed (as a reasoning task's are: most short, a few at the bound). Each timed step is
what the recipe does per optimizer step on those rows: for every micro-batch, the completion tokens'
log-probabilities and entropies (`rollouts.completion_log_probs`, which takes the packed layout when the batch has
one), the surrogate loss (`policy_gradient.per_token_losses`, dapo weights) and its backward. The two layouts come from
`rollouts.rollout_batch` and `padding_free.packed_rows`, as `rollouts.assemble_round` makes them. Rounds alternate
padded and packed so that the machine's load hits both alike; the figure is the median of the rounds' ratios.
Before timing, both layouts' log-probabilities are compared (they must agree to float tolerance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_recipes.methods.grpo import padding_free, rollouts
from fsdp_recipes.methods.grpo import policy_gradient as pg


def long_tailed_lengths(count: int, low: int, high: int, generator: torch.Generator) -> list[int]:
    """Lengths in [low, high] with most near `low`: an exponential draw, capped (completions cut at the bound)."""
    draws = torch.empty(count).exponential_(generator=generator) * (high - low) / 3
    return [min(high, low + int(d)) for d in draws]


def rollout_micro_batches(args, generator) -> tuple[list[dict], list[dict]]:
    prompt_lengths = long_tailed_lengths(args.completions, 16, args.prompt_width, generator)
    completion_lengths = long_tailed_lengths(args.completions, 8, args.completion_width, generator)
    prompts = [torch.randint(3, args.vocab, (n,), generator=generator).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, args.vocab, (n,), generator=generator).tolist() for n in completion_lengths]
    prompt_width, completion_width = max(prompt_lengths), max(completion_lengths)
    batch = rollouts.rollout_batch(
        prompts, completions, pad_token_id=0, prompt_width=prompt_width, completion_width=completion_width
    )
    batch["advantages"] = torch.randn(args.completions, generator=generator)
    padded, packed = [], []
    for start in range(0, args.completions, args.micro_batch):
        part = {key: value[start : start + args.micro_batch] for key, value in batch.items()}
        padded.append(part)
        packed.append(
            {**part, **padding_free.packed_rows(part, row_width=prompt_width + completion_width, pad_token_id=0)}
        )
    return padded, packed


def step(model, micro_batches, global_tokens: float) -> None:
    for part in micro_batches:
        log_probs, _ = rollouts.completion_log_probs(model, part, 0.7)
        terms = pg.per_token_losses(
            log_probs, log_probs.detach(), part["advantages"], epsilon=0.2, mask=part["completion_mask"]
        )
        weights = pg.token_weights(
            part["completion_mask"], "dapo", global_completions=0, global_tokens=global_tokens, max_completion_length=0
        )
        (terms["loss"] * weights).sum().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=64, help="completions per step")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch (padded layout)")
    parser.add_argument("--prompt-width", type=int, default=128, help="longest prompt")
    parser.add_argument("--completion-width", type=int, default=256, help="longest completion")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the lines")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    padded, packed = rollout_micro_batches(args, torch.Generator().manual_seed(1))
    global_tokens = float(sum(int(part["completion_mask"].sum()) for part in padded))
    with torch.no_grad():  # the same values both ways, before anything is timed
        for plain, dense in zip(padded, packed):
            mask = plain["completion_mask"].bool()
            want, got = (
                rollouts.completion_log_probs(model, plain, 0.7)[0],
                rollouts.completion_log_probs(model, dense, 0.7)[0],
            )
            torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
    padded_slots = sum(part["input_ids"].numel() for part in padded)
    packed_slots = sum(part["packed_input_ids"].numel() for part in packed)
    real = sum(int(part["attention_mask"].sum()) for part in padded)
    step(model, padded, global_tokens)  # warm-up, both
    step(model, packed, global_tokens)
    times = {"padded": [], "packed": []}
    for _ in range(args.rounds):
        for name, parts in (("padded", padded), ("packed", packed)):
            started = time.perf_counter()
            step(model, parts, global_tokens)
            times[name].append(time.perf_counter() - started)
    ratios = [p / q for p, q in zip(times["padded"], times["packed"])]
    result = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "completions": args.completions,
        "real_tokens": real,
        "padded_slots": padded_slots,
        "packed_slots": packed_slots,
        "padded_rows": sum(part["input_ids"].shape[0] for part in padded),
        "packed_rows": sum(part["packed_input_ids"].shape[0] for part in packed),
        "padded_step_s": statistics.median(times["padded"]),
        "packed_step_s": statistics.median(times["packed"]),
        "speedup_median": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:16} {value}")


if __name__ == "__main__":
    main()
