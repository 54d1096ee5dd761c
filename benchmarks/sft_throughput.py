"""Throughput of one SFT epoch, side by side: a bare PyTorch loop, our recipe, and transformers.Trainer (two ways).

    python benchmarks/sft_throughput.py            # full mode: 2,000 long-tailed chat examples (~15+ min on 2 cores)
    python benchmarks/sft_throughput.py --small    # a smoke run of every variant (under a minute; used by the tests)
    python benchmarks/sft_throughput.py --json     # one JSON object on stdout instead of the table

Every variant trains the same tiny Llama (~0.83M parameters, initialised from the config below with the same seed)
for exactly one epoch over the same synthetic chat examples, tokenised once with the recipe's own chat-template and
loss-mask code (`fsdp_recipes.data.chat`), on one process:

  (a) bare   - a plain PyTorch loop (torch.optim.AdamW, no accelerate, no clipping, no scheduler) over exactly the
               rows and batches our recipe builds (same packing, row length, sampler, collate): the floor for (b);
  (b) recipe - recipes/sft.py run as a subprocess, one plain process (or, with --recipe-launch accelerate, under
               `accelerate launch --num_processes 1` with the CPU FSDP2 config: FSDP2 over gloo with one rank); its
               training-loop time comes from output_dir/metrics.jsonl (see `recipe_loop_time`);
  (c) trainer        - transformers.Trainer, DataCollatorForSeq2Seq padding, default random sampling;
  (d) trainer_grouped - the same with train_sampling_strategy="group_by_length" (LengthGroupedSampler);
  (e) proposal - the bare loop over rows packed to at most --proposal-row-length tokens with this script's own
               length_grouped_batches: the batching proposed for the recipe before it adopted it (a cross-check).

Each of (a), (c), (d), (e) runs in a fresh child process of this script (as (b) does), unless --in-process or
--small, so no variant inherits another's allocator state or warm caches.

(c) and (d) take `--batch-examples` examples per optimizer step. (a) and (b) take the recipe's rows: with packing a
row holds several examples, so the rows per step are chosen to carry about as many real tokens per step as
`--batch-examples` examples do; whatever the rows, every variant sees every example exactly once, so the comparison
is the time for one epoch of the same real tokens (reported as real tokens/s and seconds per 1k real tokens).

Real tokens are the non-padding input tokens (prompt and completion); padding fraction = padding slots / all
slots of the batches. Only the training loop is timed: no process start-up, tokenisation, model building or export.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "demo" / "assets" / "tokenizer"
SFT = REPO / "recipes" / "sft.py"
ACCELERATE_CONFIG = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
IGNORE_INDEX = -100
VARIANTS = ("bare", "recipe", "trainer", "trainer_grouped", "proposal")
LABELS = {
    "bare": "(a) bare PyTorch loop, recipe's rows",
    "recipe": "(b) our SFT recipe",
    "trainer": "(c) Trainer, random sampling",
    "trainer_grouped": "(d) Trainer, group_by_length",
    "proposal": "(e) proposal: bare loop, packed rows <= --proposal-row-length, length-grouped",
}

# ~0.83M parameters: demo/tiny_llama.json's width with 5 layers, and positions for the longest example.
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

MODES = {
    # examples, median length, lognormal sigma, longest example (tokens); max_length stays above the longest, so
    # nothing is truncated and every variant sees the same tokens.
    "full": dict(examples=2000, median=60, sigma=0.85, longest=1000, max_length=1024),
    "small": dict(examples=96, median=40, sigma=0.7, longest=200, max_length=256),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- data ------------------------------------------------------------------------------------------------------------


def synthetic_chat(examples: int, *, median: int, sigma: float, longest: int, seed: int) -> list[dict]:
    """Deterministic conversations (one user turn, one assistant turn) whose rendered lengths are lognormal: a
    median near `median` tokens and a long tail up to `longest`, the way chat data is. The tokenizer is
    character-level, and the chat template adds 5 tokens (bos, 2 role tokens, 2 end tokens)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]

    def text(length: int) -> str:
        out = ""
        while len(out) < length:
            out += rng.choice(words) + rng.choice("     ,.?")
        return out[:length].strip() or "ok"

    records = []
    for _ in range(examples):
        total = min(longest, max(16, round(rng.lognormvariate(math.log(median), sigma))))
        chars = total - 5
        prompt = max(2, round(chars * rng.uniform(0.2, 0.6)))
        records.append(
            {
                "messages": [
                    {"role": "user", "content": text(prompt)},
                    {"role": "assistant", "content": text(chars - prompt)},
                ]
            }
        )
    return records


def tokenize(records: list[dict], tokenizer, max_length: int):
    """The recipe's own tokenisation (chat template, loss on assistant tokens), done once for every variant."""
    from datasets import Dataset

    from fsdp_recipes.data.chat import tokenize_dataset

    tokens, stats = tokenize_dataset(
        Dataset.from_list(records),
        tokenizer,
        assistant_only_loss=True,
        completion_only_loss=True,
        max_length=max_length,
        name="benchmark",
    )
    if stats["truncated"] or stats["dropped_without_loss_tokens"]:
        raise SystemExit(f"benchmark data must not be truncated or dropped: {stats}")
    return tokens


# --- model -----------------------------------------------------------------------------------------------------------


def model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL,
    )


def build_model(config, seed: int, attn_implementation: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


# --- (a) the bare loop -------------------------------------------------------------------------------------------------


def run_bare(rows, *, rows_per_step: int, pad_token_id: int, config, settings, grouped: bool = False) -> dict:
    """One epoch over the recipe's rows with the recipe's collate: forward with position_ids and no attention mask
    (so packed examples stay isolated), summed cross-entropy over the targets / their count, AdamW. Nothing else."""
    import torch
    import torch.nn.functional as F

    from fsdp_recipes.data.rows import LengthGroupedSampler, RowCollator

    model = build_model(config, settings.seed, settings.attn_implementation)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
    if grouped:
        batches = length_grouped_batches([len(ids) for ids in rows["input_ids"]], rows_per_step, seed=settings.seed)
        loader = torch.utils.data.DataLoader(rows, batch_sampler=batches, collate_fn=RowCollator(pad_token_id))
    else:  # the recipe's default sampling (train_sampling_strategy: group_by_length), for the same batches as (b)
        sampler = LengthGroupedSampler(
            [len(ids) for ids in rows["input_ids"]], group_size=rows_per_step, seed=settings.seed
        )
        loader = torch.utils.data.DataLoader(
            rows, batch_size=rows_per_step, sampler=sampler, collate_fn=RowCollator(pad_token_id)
        )
    real = slots = steps = 0
    step_times = []
    start = time.perf_counter()
    for batch in loader:
        step_start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        targets = batch["targets"]
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        (loss / (targets != IGNORE_INDEX).sum().clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - step_start)
        real += int(batch["real_tokens"].sum())
        slots += batch["input_ids"].numel()
        steps += 1
    wall = time.perf_counter() - start
    return dict(wall_s=wall, steps=steps, real_tokens=real, slots=slots, median_step_s=_median(step_times))


def warm_up(config, settings) -> None:
    """A few untimed steps on a throwaway model, so the first in-process variant does not pay this process's one-time
    costs (kernel selection, allocator growth) that the later ones would not."""
    import torch

    model = build_model(config, settings.seed, settings.attn_implementation)
    for length in (32, 128, 64):
        ids = torch.randint(3, config.vocab_size, (4, length))
        model(
            input_ids=ids, position_ids=torch.arange(length).expand(4, length), use_cache=False
        ).logits.sum().backward()


def length_grouped_batches(lengths: list[int], batch_size: int, *, seed: int, megabatch: int = 50) -> list[list[int]]:
    """The batching proposed for the recipe, (e): shuffle, cut into mega-batches of `megabatch` batches, sort each by
    length, cut into batches, shuffle the batches. Rows of similar length share a batch, the order stays random."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    size = megabatch * batch_size
    batches = []
    for start in range(0, len(order), size):
        chunk = sorted(order[start : start + size], key=lambda i: -lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# --- (b) the recipe ------------------------------------------------------------------------------------------------------


def recipe_loop_time(records: list[dict], expected_tokens: int) -> tuple[float, str]:
    """Training-loop seconds from metrics.jsonl. Uses a cumulative loop time if the recipe logs one (`train_time_s`,
    `elapsed_s` or `elapsed`), else the sum of per-window times (`window_s`), else, with one
    logging window covering the whole loop (logging_steps >= steps, as this benchmark sets), the real tokens of the
    epoch divided by that window's `tokens_per_second` (the recipe's window starts right before the loop)."""
    train = [r for r in records if "tokens_per_second" in r]
    if not train:
        raise RuntimeError("the recipe's metrics.jsonl has no tokens_per_second record")
    last = train[-1]
    for key in ("train_time_s", "elapsed_s", "elapsed"):
        if isinstance(last.get(key), (int, float)):
            return float(last[key]), f"metrics.jsonl {key}"
    if all(isinstance(r.get("window_s"), (int, float)) for r in train):
        return sum(float(r["window_s"]) for r in train), "metrics.jsonl window_s, summed"
    if len(train) == 1:
        return expected_tokens / float(last["tokens_per_second"]), "epoch tokens / tokens_per_second (one window)"
    raise RuntimeError("several logging windows and no elapsed-time field: set logging_steps >= the number of steps")


def load_sft_recipe():
    """recipes/sft.py as a module (its config class lives there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sft_recipe", SFT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_recipe(
    work: Path, data_file: Path, *, rows_per_step: int, steps: int, expected_tokens: int, settings, tag: str = ""
) -> dict:
    import yaml

    known = {field.name for field in dataclasses.fields(load_sft_recipe().SFTConfig)}
    output_dir = work / f"recipe_output{tag}"
    values = dict(
        model_config=str(work / "model" / "config.json"),
        tokenizer_name_or_path=str(TOKENIZER),
        dataset_name=str(data_file),
        dataset_test_split=None,
        eval_split_size=0.0,
        max_length=settings.recipe_max_length,
        packing=settings.packing,
        packing_row_length=settings.packing_row_length,
        train_sampling_strategy="group_by_length",
        per_device_train_batch_size=rows_per_step,
        gradient_accumulation_steps=1,
        num_train_epochs=1.0,
        max_steps=-1,
        learning_rate=settings.learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=steps + 1,
        save_steps=None,
        output_dir=str(output_dir),
        seed=settings.seed,
        attn_implementation=settings.attn_implementation,
    )
    optional = dict(report_to="none", exact_match_eval_samples=0)  # fields that some versions of the recipe have
    values.update({key: value for key, value in optional.items() if key in known})
    config_file = work / f"recipe{tag}.yaml"
    config_file.write_text(yaml.safe_dump(values))
    launcher = Path(sys.executable).with_name("accelerate")
    if settings.recipe_launch == "accelerate":
        command = [
            str(launcher),
            "launch",
            "--config_file",
            str(ACCELERATE_CONFIG),
            "--num_processes",
            "1",
            str(SFT),
            "--config",
            str(config_file),
        ]
    else:
        command = [sys.executable, str(SFT), "--config", str(config_file)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(
            f"recipe failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "tokens_per_second" in r]
    if train[-1]["step"] != steps:
        raise RuntimeError(f"the recipe ran {train[-1]['step']} steps, expected {steps} (one epoch)")
    wall, source = recipe_loop_time(records, expected_tokens)
    if isinstance(train[-1].get("train_tokens"), (int, float)):  # cumulative real tokens, if the recipe logs them
        tokens = train[-1]["train_tokens"]
    else:  # per-window real tokens, if logged; else the epoch's tokens (the recipe ran exactly one epoch of these rows)
        tokens = (
            sum(r["real_tokens"] for r in train if isinstance(r.get("real_tokens"), (int, float))) or expected_tokens
        )
    padding = next((train[-1][k] for k in ("padding_fraction",) if isinstance(train[-1].get(k), (int, float))), None)
    if padding is None:
        real_fraction = train[-1].get("real_token_fraction") or train[-1].get("batch_fill")
        padding = 1.0 - real_fraction if isinstance(real_fraction, (int, float)) else None
    return dict(
        wall_s=wall,
        steps=steps,
        real_tokens=int(tokens),
        padding_fraction=padding,
        timing_source=source,
        process_s=process_s,
        command=" ".join(Path(c).name if c == str(launcher) else c for c in command),
    )


# --- (c), (d) transformers.Trainer -------------------------------------------------------------------------------------


def run_trainer(tokens, tokenizer, *, config, settings, grouped: bool, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    input_ids = tokens["input_ids"]
    features = Dataset.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": [[1] * len(ids) for ids in input_ids],
            "labels": [
                [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]
                for ids, mask in zip(input_ids, tokens["loss_mask"])
            ],
            "length": [len(ids) for ids in input_ids],  # precomputed, as a careful user gives LengthGroupedSampler
        }
    )
    padder = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)
    seen = {"real": 0, "slots": 0}

    def collate(examples):
        batch = padder([{k: v for k, v in e.items() if k != "length"} for e in examples])
        seen["real"] += int(batch["attention_mask"].sum())
        seen["slots"] += batch["input_ids"].numel()
        return batch

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin = self.end = self.step_start = None
            self.step_times = []

        def on_train_begin(self, *args, **kwargs):
            self.begin = time.perf_counter()

        def on_step_begin(self, *args, **kwargs):
            self.step_start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.step_times.append(time.perf_counter() - self.step_start)

        def on_train_end(self, *args, **kwargs):
            self.end = time.perf_counter()

    args = TrainingArguments(
        output_dir=str(work / ("trainer_grouped" if grouped else "trainer")),
        per_device_train_batch_size=settings.batch_examples,
        num_train_epochs=1,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=settings.seed,
        data_seed=settings.seed,
        use_cpu=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        train_sampling_strategy="group_by_length" if grouped else "random",
    )
    clock = Clock()
    model = build_model(config, settings.seed, settings.attn_implementation)
    trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collate, callbacks=[clock])
    with contextlib.redirect_stdout(sys.stderr):  # Trainer prints its metrics: keep stdout for the report
        output = trainer.train()
    del trainer, model
    torch.set_grad_enabled(True)
    return dict(
        wall_s=clock.end - clock.begin,
        steps=output.global_step,
        real_tokens=seen["real"],
        slots=seen["slots"],
        median_step_s=_median(clock.step_times),
        train_runtime_s=output.metrics.get("train_runtime"),
    )


# --- report -------------------------------------------------------------------------------------------------------------


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def finish(result: dict) -> dict:
    if result.get("padding_fraction") is None and result.get("slots"):
        result["padding_fraction"] = 1.0 - result["real_tokens"] / result["slots"]
    result["step_time_s"] = result["wall_s"] / max(result["steps"], 1)
    result["real_tokens_per_s"] = result["real_tokens"] / result["wall_s"]
    result["s_per_1k_real_tokens"] = 1000.0 * result["wall_s"] / result["real_tokens"]
    return result


def add_ratios(results: dict) -> None:
    for name, result in results.items():
        for base in ("bare", "trainer", "trainer_grouped"):
            if base in results and name != base:
                result[f"tokens_per_s_vs_{base}"] = result["real_tokens_per_s"] / results[base]["real_tokens_per_s"]
        if "bare" in results:
            # time per real token relative to the floor: 1.00 = as fast as the bare loop; the target is <= 1.05
            result["time_per_token_vs_bare"] = results["bare"]["real_tokens_per_s"] / result["real_tokens_per_s"]


def table(report: dict) -> str:
    results = report["results"]
    lines = [
        f"one epoch: {report['data']['examples']} examples, {report['data']['real_tokens']:,} real tokens "
        f"(median {report['data']['median_length']}, max {report['data']['max_length']} tokens); "
        f"model {report['model']['parameters'] / 1e6:.2f}M params; torch threads {report['machine']['torch_threads']}; "
        f"load average before/after {report['machine']['load_average_before'][0]:.2f}/{report['machine'].get('load_average_after', [0])[0]:.2f}",
        "",
        "| variant | steps | batch | loop wall s | step ms | real tok/s | padding | time/token vs (a) | tok/s vs (c) | tok/s vs (d) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        padding = "n/a" if r.get("padding_fraction") is None else f"{r['padding_fraction']:.1%}"
        lines.append(
            f"| {LABELS[name]} | {r['steps']} | {r['batch']} | {r['wall_s']:.1f} | {1000 * r['step_time_s']:.1f} | "
            f"{r['real_tokens_per_s']:,.0f} | {padding} | {_ratio(r, 'time_per_token_vs_bare')} | "
            f"{_ratio(r, 'tokens_per_s_vs_trainer')} | {_ratio(r, 'tokens_per_s_vs_trainer_grouped')} |"
        )
    if "recipe" in results:
        lines += [
            "",
            f"(b) loop time from: {results['recipe']['timing_source']}; command: {results['recipe']['command']}",
        ]
    return "\n".join(lines)


def _ratio(result: dict, key: str) -> str:
    return f"{result[key]:.2f}x" if key in result else "-"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny data: a smoke run of every variant (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}"
    )
    parser.add_argument("--examples", type=int, help="number of examples (default: 2000 full, 96 small)")
    parser.add_argument(
        "--batch-examples", type=int, default=16, help="examples per optimizer step for (c), (d) and unpacked (a), (b)"
    )
    parser.add_argument(
        "--packing",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=True,
        help="the recipe's packing (true/false)",
    )
    parser.add_argument(
        "--recipe-max-length",
        type=int,
        help="the recipe's max_length (truncation and packed row length); default: no truncation",
    )
    parser.add_argument(
        "--rows-per-step",
        type=int,
        help="rows per step for (a) and (b); default: ~the real tokens of --batch-examples examples",
    )
    parser.add_argument(
        "--packing-row-length",
        type=int,
        default=256,
        help="the recipe's packing_row_length for (a) and (b): tokens per packed row (longer examples get a row of their own)",
    )
    parser.add_argument(
        "--recipe-launch",
        choices=("accelerate", "python"),
        default="python",
        help="accelerate: `accelerate launch --num_processes 1` with the CPU FSDP2 config; python: plain `python recipes/sft.py` (no FSDP)",
    )
    parser.add_argument(
        "--proposal-row-length",
        type=int,
        default=256,
        help="(e): pack into rows of at most this many tokens (longer examples get a row of their own, untruncated)",
    )
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every variant N times, interleaved, and report the fastest run of each (the machine may be shared)",
    )
    parser.add_argument("--workdir", help="keep the data, configs and outputs here (default: a temporary folder)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run (a), (c), (d), (e) in this process (default: each run in a fresh child process, as (b) is; --small implies this)",
    )
    parser.add_argument("--child", choices=[v for v in VARIANTS if v != "recipe"], help=argparse.SUPPRESS)
    settings = parser.parse_args(argv)
    settings.in_process = settings.in_process or settings.small  # the smoke run is about coverage, not timing
    mode = dict(MODES["small" if settings.small else "full"])
    if settings.examples:
        mode["examples"] = settings.examples
    settings.recipe_max_length = settings.recipe_max_length or mode["max_length"]
    variants = [v.strip() for v in settings.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")

    import torch
    from transformers import AutoTokenizer

    from fsdp_recipes.data.rows import build_rows

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    records = synthetic_chat(
        mode["examples"], median=mode["median"], sigma=mode["sigma"], longest=mode["longest"], seed=settings.seed
    )
    tokens = tokenize(records, tokenizer, mode["max_length"])
    lengths = sorted(len(ids) for ids in tokens["input_ids"])
    epoch_tokens = sum(lengths)
    config = model_config(tokenizer)

    # The recipe's rows (and so (a)'s): built exactly as recipes/sft.py builds them.
    if settings.recipe_max_length < lengths[-1]:
        log(
            f"note: --recipe-max-length {settings.recipe_max_length} truncates the {sum(length > settings.recipe_max_length for length in lengths)} "
            f"longest examples, so (a) and (b) see fewer real tokens than (c) and (d)"
        )
    recipe_tokens = (
        tokens
        if settings.recipe_max_length >= lengths[-1]
        else tokenize(records, tokenizer, settings.recipe_max_length)
    )
    row_length = settings.packing_row_length or settings.recipe_max_length
    rows = build_rows(
        recipe_tokens,
        max_length=row_length if settings.packing else settings.recipe_max_length,
        packing=settings.packing,
    )
    row_lengths = [len(r) for r in rows["input_ids"]]
    rows_tokens = sum(row_lengths)
    if settings.rows_per_step is None:
        per_step = settings.batch_examples * epoch_tokens / len(lengths)
        settings.rows_per_step = (
            max(1, round(per_step / (rows_tokens / len(rows)))) if settings.packing else settings.batch_examples
        )
    recipe_steps = math.ceil(len(rows) / settings.rows_per_step)
    # (e): the change proposed for the recipe, measured in the bare loop (build_rows packs but never truncates).
    proposal_rows = build_rows(tokens, max_length=settings.proposal_row_length, packing=True)
    proposal_rows_per_step = max(
        1, round(settings.batch_examples * epoch_tokens / len(lengths) / (epoch_tokens / len(proposal_rows)))
    )

    report = {
        "mode": "small" if settings.small else "full",
        "data": {
            "examples": len(lengths),
            "real_tokens": epoch_tokens,
            "median_length": lengths[len(lengths) // 2],
            "mean_length": round(epoch_tokens / len(lengths), 1),
            "p99_length": lengths[int(0.99 * (len(lengths) - 1))],
            "max_length": lengths[-1],
            "distribution": f"lognormal(median {mode['median']}, sigma {mode['sigma']}), clipped to [16, {mode['longest']}]",
        },
        "model": {"parameters": sum(p.numel() for p in build_model(config, 0, "sdpa").parameters()), **MODEL},
        "recipe_rows": {
            "packing": settings.packing,
            "max_length": settings.recipe_max_length,
            "rows": len(rows),
            "mean_row_length": round(rows_tokens / len(rows), 1),
            "rows_per_step": settings.rows_per_step,
            "real_tokens_per_step": round(rows_tokens / recipe_steps, 1),
        },
        "proposal_rows": {
            "row_length": settings.proposal_row_length,
            "rows": len(proposal_rows),
            "rows_per_step": proposal_rows_per_step,
            "longest_row": max(len(r) for r in proposal_rows["input_ids"]),
        },
        "trainer_batch": {
            "examples_per_step": settings.batch_examples,
            "real_tokens_per_step": round(epoch_tokens / math.ceil(len(lengths) / settings.batch_examples), 1),
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_before": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "accelerate": __import__("accelerate").__version__,
        },
        "settings": {k: v for k, v in vars(settings).items() if k not in ("json", "workdir")},
        "results": {},
    }

    with tempfile.TemporaryDirectory(prefix="sft_bench_") as temporary:
        work = Path(settings.workdir or temporary)
        (work / "model").mkdir(parents=True, exist_ok=True)
        config.to_json_file(work / "model" / "config.json")
        data_file = work / "train.jsonl"
        data_file.write_text("".join(json.dumps(r) + "\n" for r in records))

        def run_in_child(name: str) -> dict:
            args = [
                "--examples",
                str(mode["examples"]),
                "--batch-examples",
                str(settings.batch_examples),
                "--packing",
                str(settings.packing),
                "--recipe-max-length",
                str(settings.recipe_max_length),
                "--packing-row-length",
                str(settings.packing_row_length),
                "--rows-per-step",
                str(settings.rows_per_step),
                "--proposal-row-length",
                str(settings.proposal_row_length),
                "--attn-implementation",
                settings.attn_implementation,
                "--learning-rate",
                str(settings.learning_rate),
                "--seed",
                str(settings.seed),
                "--workdir",
                str(work),
                "--child",
                name,
            ] + (["--small"] if settings.small else [])
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            child = subprocess.run([sys.executable, __file__, *args], cwd=REPO, env=env, capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"{name} failed (exit {child.returncode}):\n{child.stderr[-5000:]}")
            return json.loads(child.stdout)

        if settings.child or settings.in_process:
            warm_up(config, settings)
        if settings.child:
            variants = [settings.child]
        runs = {name: [] for name in variants}
        for repeat in range(settings.repeats):
            for name in variants:
                log(f"running {LABELS[name]} (run {repeat + 1} of {settings.repeats}) ...")
                if name != "recipe" and not (settings.child or settings.in_process):
                    result = run_in_child(name)
                elif name == "bare":
                    result = run_bare(
                        rows,
                        rows_per_step=settings.rows_per_step,
                        pad_token_id=tokenizer.pad_token_id,
                        config=config,
                        settings=settings,
                    )
                    result["batch"] = f"{settings.rows_per_step} rows"
                elif name == "proposal":
                    result = run_bare(
                        proposal_rows,
                        rows_per_step=proposal_rows_per_step,
                        pad_token_id=tokenizer.pad_token_id,
                        config=config,
                        settings=settings,
                        grouped=True,
                    )
                    result["batch"] = f"{proposal_rows_per_step} rows"
                elif name == "recipe":
                    result = run_recipe(
                        work,
                        data_file,
                        rows_per_step=settings.rows_per_step,
                        steps=recipe_steps,
                        expected_tokens=rows_tokens,
                        settings=settings,
                        tag=f"_{repeat}",
                    )
                    result["batch"] = f"{settings.rows_per_step} rows"
                else:
                    result = run_trainer(
                        tokens,
                        tokenizer,
                        config=config,
                        settings=settings,
                        grouped=name == "trainer_grouped",
                        work=work,
                    )
                    result["batch"] = f"{settings.batch_examples} ex"
                if settings.child:
                    print(json.dumps(finish(result)))
                    return finish(result)
                runs[name].append(finish(result))
                log(f"  {result['wall_s']:.1f} s, {result['real_tokens_per_s']:,.0f} real tokens/s")
        for name in variants:
            best = dict(min(runs[name], key=lambda r: r["wall_s"]))
            best["all_wall_s"] = [round(r["wall_s"], 3) for r in runs[name]]
            report["results"][name] = best
        if (
            "recipe" in report["results"]
            and report["results"]["recipe"]["padding_fraction"] is None
            and "bare" in report["results"]
        ):
            # Same rows, same rows per step, a different shuffle: (a)'s padding is the expected value.
            report["results"]["recipe"]["padding_fraction"] = report["results"]["bare"]["padding_fraction"]
            report["results"]["recipe"]["padding_source"] = "estimated from (a): same rows and rows per step"
        report["machine"]["load_average_after"] = os.getloadavg()
    add_ratios(report["results"])
    report["same_real_tokens"] = len({r["real_tokens"] for r in report["results"].values()}) == 1
    print(json.dumps(report, indent=2) if settings.json else table(report))
    return report


if __name__ == "__main__":
    main()
