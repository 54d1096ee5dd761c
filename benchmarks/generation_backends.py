"""Completion tokens per second of each generation backend (`generation_backend`: generate, paged, static_compiled),
through the recipes' own `train.generation.generate_completions`, on the same prompts with the same keys, and whether
they wrote the same completions (docs/grpo.md, Generation).

    python benchmarks/generation_backends.py --model outputs/demo_reverse_partial          # the GRPO demo's start
    python benchmarks/generation_backends.py --model-config benchmarks/llama_1b.json \\
        --device cuda --dtype bfloat16 --max-new-tokens 32 256                                # the GPU check's

The work: --prompts prompts of the GRPO demo (demo/assets/reverse_prompts/test.jsonl) x --generations completions
each, sampled at temperature 0.7 (GRPO's keys: one per completion), at most --max-new-tokens tokens, `generate` and
`static_compiled` in batches of --batch-size, `paged` given every request at once. One process, the model unsharded
(as under FSDP2 with the weights gathered for the pass). After a warm-up pass of each backend (static_compiled's
compile, the engine's first start), --rounds rounds of one timed pass per backend, the backends' order alternating
so that a shared machine's changing load hits them alike; the figure is each backend's median, tokens counted as
generated (end of sequence included). A model built from --model-config has random weights: its completions rarely
end before the limit, which makes every pass the same length. Prints one JSON object after a line `== report`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

PROMPTS = REPO / "demo" / "assets" / "reverse_prompts" / "test.jsonl"
TOKENIZER = REPO / "demo" / "assets" / "tokenizer"


def load(args):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        config = AutoConfig.from_pretrained(args.model_config)
        config.vocab_size = max(config.vocab_size, len(tokenizer))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    return model.to(args.device).eval(), tokenizer


def main() -> None:
    from fsdp_recipes.methods.grpo.prompts import tokenize_prompt
    from fsdp_recipes.train import generation, generation_backends

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model folder (weights and tokenizer)")
    source.add_argument("--model-config", help="a config.json: random weights, the repo's tokenizer")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[12])
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (generate, static)")
    parser.add_argument("--backends", nargs="+", default=list(generation_backends.TRANSFORMERS_BACKENDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile-backend", default="inductor", help="static_compiled's torch.compile backend")
    args = parser.parse_args()

    model, tokenizer = load(args)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[: args.prompts]]
    prompts = [tokenize_prompt(row["prompt"], tokenizer) for row in rows for _ in range(args.generations)]
    keys = list(range(len(prompts)))
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "completions": len(prompts),
        "torch": torch.__version__,
    }
    for limit in args.max_new_tokens:
        settings = {
            backend: generation.GenerationSettings(
                limit,
                temperature=0.7,
                batch_size=args.batch_size,
                seed=42,
                backend=backend,
                compile_backend=args.compile_backend,
            )  # fmt: skip
            for backend in args.backends
        }
        outputs, speeds, warmup = {}, {backend: [] for backend in args.backends}, {}
        for backend in args.backends:
            start = time.perf_counter()
            outputs[backend] = generation.generate_completions(
                model, tokenizer, prompts, keys, settings[backend], synced_gpus=False
            )
            warmup[backend] = round(time.perf_counter() - start, 2)
        for round_index in range(args.rounds):
            order = args.backends if round_index % 2 == 0 else args.backends[::-1]
            for backend in order:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                completions, _ = generation.generate_completions(
                    model, tokenizer, prompts, keys, settings[backend], synced_gpus=False
                )
                if args.device == "cuda":
                    torch.cuda.synchronize()
                speeds[backend].append(sum(map(len, completions)) / (time.perf_counter() - start))
        first = outputs[args.backends[0]]
        report[f"max_new_tokens={limit}"] = {
            "tokens_per_s": {backend: round(statistics.median(speeds[backend])) for backend in args.backends},
            "range": {backend: [round(min(s)), round(max(s))] for backend, s in speeds.items()},
            "first_pass_s": warmup,
            "generated_tokens": sum(map(len, first[0])),
            "identical_completions": {backend: outputs[backend] == first for backend in args.backends},
        }
        print(json.dumps({limit: report[f"max_new_tokens={limit}"]}), file=sys.stderr, flush=True)
    print("== report\n" + json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
