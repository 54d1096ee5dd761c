"""TRL's SFTTrainer on the work of benchmarks/gpu_check.py's SFT: the same model, data, row length and rows per step,
so that its tokens/s stand beside the recipe's (the ratio is the issue's measure).

    python benchmarks/sft_vs_trl.py --batch-size 16 --liger                 # one CUDA GPU, trl installed
    python benchmarks/sft_vs_trl.py --model-config demo/tiny_llama.json --max-length 128 --steps 6   # CPU smoke run
    python benchmarks/sft_vs_trl.py --with-recipe --model-config small --max-length 512 --batch-size 8 --steps 30 \
        --rounds 3                          # CPU: recipes/sft.py and TRL alternated, fp32, one process each

TRL is not a dependency of this repo: on the GPU machine its wheel is carried (benchmarks/gpu_wheels.sh); here it can
live in a folder of its own on PYTHONPATH. What TRL gets is what its docs recommend for speed without flash-attn:
- the model initialised from the same config with the same seed (the 1.1B of benchmarks/llama_1b.json);
- the demo's chat data, with the recipe's tokenizer and chat template (`demo/assets/tokenizer`);
- packing="bfd" into rows of --max-length, which turns on padding-free batches: the batch's rows are flattened into one
  sequence with position ids, and transformers' mask functions keep every example to itself;
- bf16, its default AdamW and gradient clipping; Liger's kernels with --liger (its fused linear cross-entropy);
- one process, no FSDP (a user's TRL run on one GPU); the recipe runs FSDP2 over its one rank.

Speed is real tokens per second between the end of step --warmup-steps and the last step's end, the device
synchronised at both ends. MFU uses the recipe's own FLOPs-per-token accounting and peak (fsdp_recipes.train.metrics).
One JSON object is printed last, after "== report".

With --with-recipe, recipes/sft.py (recipes/configs/sft/gpu_check_1b.yaml, one plain process) and TRL run alternately
in fresh processes, --rounds times, on the same sizes; the recipe's speed is the mean of its logged windows after the
first (5 steps, as TRL's --warmup-steps), and the figure is the median of the rounds' ratios. Both train on every
token (TRL's default for conversational data; the recipe's `assistant_only_loss: false`): the recipe's default, the
assistant's tokens only, would spare it the output layer for the other tokens and make the work unequal.
`--model-config small` is a 4-layer, 512-wide Llama of the 1.1B's shape (GQA 8/2, vocabulary 32,000): 44M parameters,
33M of them the embedding and the output layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip


def model_config_path(name: str, folder: Path) -> Path:
    if name != "small":
        return REPO / name
    config = json.loads((REPO / "benchmarks" / "llama_1b.json").read_text()) | SMALL
    path = folder / "llama_small.json"
    path.write_text(json.dumps(config))
    return path


def recipe_run(args, model_config: Path, output_dir: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_check import training_figures

    command = [
        sys.executable, str(REPO / "recipes" / "sft.py"), "--config", str(REPO / "recipes/configs/sft/gpu_check_1b.yaml"),
        "--model_config", str(model_config), "--output_dir", str(output_dir), "--max_length", str(args.max_length),
        "--per_device_train_batch_size", str(args.batch_size), "--max_steps", str(args.steps), "--logging_steps", "5",
        "--attn_implementation", args.attn, "--assistant_only_loss", "false",
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, check=True, cwd=REPO, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return training_figures(output_dir)


def trl_run(args, model_config: Path, output_dir: Path) -> dict:
    command = [sys.executable, __file__, "--model-config", str(model_config), "--max-length", str(args.max_length),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--attn", args.attn,
               "--out", str(output_dir)]  # fmt: skip
    result = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads(result.stdout[result.stdout.rindex("== report") + len("== report") :])


def side_by_side(args) -> None:
    ratios, rounds = [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model_config = model_config_path(args.model_config, folder)
        for index in range(args.rounds):
            ours = recipe_run(args, model_config, folder / f"ours{index}")
            theirs = trl_run(args, model_config, folder / f"trl{index}")
            speeds = ours["tokens_per_second_per_device"], theirs["tokens_per_second_per_device"]
            ratios.append(speeds[0] / speeds[1])
            rounds.append({"recipe": round(speeds[0]), "trl": round(speeds[1]), "ratio": round(ratios[-1], 3),
                           "recipe_tokens_per_step": round(speeds[0] * ours["step_time_s"]),
                           "trl_tokens_per_step": round(theirs["tokens_per_step"])})  # fmt: skip
            print(f"round {index + 1}: recipe {speeds[0]:,.0f} tokens/s, TRL {speeds[1]:,.0f}, "
                  f"ratio {ratios[-1]:.2f}", flush=True)  # fmt: skip
    report = {"median_ratio": round(statistics.median(ratios), 3), "rounds": rounds, "trl": theirs["trl"]}
    print("== report " + json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="benchmarks/llama_1b.json")
    parser.add_argument("--tokenizer", default="demo/assets/tokenizer")
    parser.add_argument("--data", default="demo/assets/reverse/train.jsonl")
    parser.add_argument("--max-length", type=int, default=2048, help="row length (the recipe config's max_length)")
    parser.add_argument("--batch-size", type=int, default=4, help="packed rows per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the speed (start-up, autotune)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa, flex_attention...")
    parser.add_argument("--liger", action="store_true", help="use_liger_kernel (Triton: CUDA only)")
    parser.add_argument("--out", default="outputs/sft_vs_trl")
    parser.add_argument("--with-recipe", action="store_true", help="recipes/sft.py and TRL, alternated (see above)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.with_recipe:
        return side_by_side(args)
    sys.path.insert(0, str(REPO / "src"))

    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import SFTConfig, SFTTrainer

    from fsdp_recipes.models.modeling import count_non_embedding_parameters
    from fsdp_recipes.train.metrics import device_name, flops_per_token, peak_flops_per_device

    cuda = torch.cuda.is_available()
    set_seed(42)
    model_config = AutoConfig.from_pretrained(model_config_path(args.model_config, Path(tempfile.mkdtemp())))
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation=args.attn)
    tokenizer = AutoTokenizer.from_pretrained(REPO / args.tokenizer)
    data = datasets.load_dataset("json", data_files=str(REPO / args.data), split="train")

    collated: list[int] = []  # real tokens of each batch, in the order the trainer asks for them
    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    config = SFTConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, max_length=args.max_length,
        packing=True, packing_strategy="bfd", bf16=cuda, use_cpu=not cuda, use_liger_kernel=args.liger,
        learning_rate=1e-4, warmup_steps=min(5, args.steps), logging_steps=5, save_strategy="no", report_to="none",
        seed=42, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Timer()])
    collator = trainer.data_collator

    def counting_collator(examples):
        batch = collator(examples)
        mask = batch.get("attention_mask")
        collated.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        return batch

    trainer.data_collator = counting_collator
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()

    first = min(args.warmup_steps, len(ends) - 2)
    seconds = ends[-1] - ends[first]
    # each batch is collated before its step: the steps after `first` are batches first+1 .. len(ends)
    tokens = sum(collated[first + 1 : len(ends)])
    per_second = tokens / seconds
    non_embedding = count_non_embedding_parameters(trainer.model)
    per_token = flops_per_token(model_config, non_embedding_parameters=non_embedding, sequence_length=args.max_length)
    peak = peak_flops_per_device(device_name(torch.device("cuda"))) if cuda else None
    report = {
        "trl": __import__("trl").__version__,
        "attn_implementation": args.attn,
        "use_liger_kernel": args.liger,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "timed_steps": len(ends) - 1 - first,
        "tokens_per_step": tokens / max(len(ends) - 1 - first, 1),
        "tokens_per_second_per_device": per_second,
        "step_time_s": seconds / max(len(ends) - 1 - first, 1),
        "mfu": per_second * per_token / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": [round(r["loss"], 4) for r in trainer.state.log_history if "loss" in r],
    }
    print("== report " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
