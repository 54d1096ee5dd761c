"""Packed rows through each attention route on this machine: sdpa (given a dense block-diagonal mask), eager, and
FlexAttention (a block mask), forward only, since torch's FlexAttention has no backward on CPU; each route's token
losses are checked equal to sdpa's first. The first flex call compiles its kernel: its time is reported apart.

    python benchmarks/attention_routes.py [--model demo/tiny_llama.json] [--rows 8] [--row-length 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def packed_batch(rows: int, row_length: int, vocab: int, seed: int = 0):
    """Rows of examples of random lengths (16 to row_length / 2 tokens), positions restarting per example."""
    generator = torch.Generator().manual_seed(seed)
    ids, positions = [], []
    for _ in range(rows):
        row_positions = []
        while len(row_positions) < row_length:
            length = int(torch.randint(16, row_length // 2, (1,), generator=generator))
            row_positions += list(range(min(length, row_length - len(row_positions))))
        positions.append(row_positions)
        ids.append(torch.randint(3, vocab, (row_length,), generator=generator).tolist())
    return torch.tensor(ids), torch.tensor(positions)


def token_losses(model, ids, positions):
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo/tiny_llama.json", help="a config.json (random weights)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.model)
    config.max_position_embeddings = max(config.max_position_embeddings, args.row_length)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, positions = packed_batch(args.rows, args.row_length, config.vocab_size)
    results, reference = {}, None
    for route in ("sdpa", "eager", "flex_attention"):
        model.set_attn_implementation(route)
        with torch.no_grad():
            start = time.perf_counter()
            losses = token_losses(model, ids, positions)
            first = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                token_losses(model, ids, positions)
                times.append(time.perf_counter() - start)
        reference = losses if reference is None else reference
        results[route] = {
            "first_call_s": round(first, 3),
            "forward_s": round(sorted(times)[len(times) // 2], 4),
            "tokens_per_s": round(ids.numel() / sorted(times)[len(times) // 2]),
            "max_loss_difference_from_sdpa": float((losses - reference).abs().max()),
        }
    print(
        json.dumps({"torch": torch.__version__, "rows": args.rows, "row_length": args.row_length, **results}, indent=1)
    )


if __name__ == "__main__":
    main()
