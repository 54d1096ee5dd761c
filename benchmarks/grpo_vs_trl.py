"""recipes/grpo.py against TRL's GRPOTrainer on the same work: completion tokens per second.

    python -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.24.0 \\
        accelerate==1.15.0 datasets==5.2.0 trl        # TRL is not a dependency of this repo: a venv of its own
    python benchmarks/grpo_vs_trl.py --trl-python /tmp/trlvenv/bin/python --model outputs/demo_reverse_partial

The same work on both, one process each, run one after the other in fresh child processes: the same initial weights
(--model, the GRPO demo's start), the demo's prompts (demo/assets/reverse_prompts), 32 prompts x 8 completions per
optimizer step, at most 12 completion tokens sampled at temperature 0.7 with transformers' engines (--backends:
generate = TRL's plain `generate` and our `generation_backend: generate`; paged = TRL's `use_transformers_paged` and
our `generation_backend: paged`; `use_vllm` off), the same reward functions (this repo's exact_match and partial_match,
which have TRL's signature), loss_type dapo, beta 0, one update per generation round, AdamW at lr 3e-4, fp32, seed 42.
TRL forwards all 256 completions as one batch; ours is given one micro-batch of 256 as well. Activation
checkpointing is off on both (TRL's GRPOConfig turns it on by default: it would cost TRL a second forward).

Measured: completion tokens generated per second of training-loop time, over steps 2..--steps (the first step,
with its warm-up, is left out): ours from metrics.jsonl (`tokens/generated`, `step_time_s` with logging_steps 1),
TRL's from a callback (the time between consecutive `on_step_end`, and `completions/mean_length` x completions from
its logs). Both count the completion tokens as generated, end of sequence included. Rounds alternate ours and TRL's
(--rounds) so that the shared machine's load hits both alike; the figure is the median of the rounds' ratios.
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
PROMPTS = REPO / "demo" / "assets" / "reverse_prompts"
COMPLETIONS_PER_STEP, GENERATIONS, MAX_COMPLETION, TEMPERATURE, LEARNING_RATE, SEED = 256, 8, 12, 0.7, 3e-4, 42


def ours(model: str, steps: int, output_dir: Path, backend: str = "generate") -> dict:
    command = [
        sys.executable, str(REPO / "recipes" / "grpo.py"), "--config", str(REPO / "recipes/configs/grpo/demo_reverse.yaml"),
        "--model_name_or_path", model, "--output_dir", str(output_dir), "--max_steps", str(steps),
        "--per_device_train_batch_size", str(COMPLETIONS_PER_STEP), "--per_device_eval_batch_size",
        str(COMPLETIONS_PER_STEP), "--num_generations", str(GENERATIONS), "--max_completion_length", str(MAX_COMPLETION),
        "--temperature", str(TEMPERATURE), "--learning_rate", str(LEARNING_RATE), "--scale_rewards", "group",
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--logging_steps", "1", "--save_steps", "null",
        "--seed", str(SEED), "--generation_backend", backend,
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "step" in r and r["step"] >= 2 and "tokens/generated" in r]
    return {
        "steps": len(steady),
        "tokens": sum(r["tokens/generated"] for r in steady),
        "seconds": sum(r["step_time_s"] for r in steady),
        "reward": statistics.mean(r["reward"] for r in steady),
    }


def trl_child(model: str, steps: int, output_dir: str, paged: bool = False) -> None:
    """Runs in the TRL venv: GRPOTrainer on the same work, one JSON line of what it measured on stdout."""
    sys.path.insert(0, str(REPO / "src"))  # this repo's reward functions (plain Python + torch)
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fsdp_recipes.methods.grpo.rewards import exact_match, partial_match

    ends, lengths = [], []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    data = datasets.load_dataset("json", data_files=str(PROMPTS / "train.jsonl"), split="train")
    config = GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=COMPLETIONS_PER_STEP,
        num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, loss_type="dapo", beta=0.0,
        scale_rewards="group", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        seed=SEED, use_vllm=False, dataloader_num_workers=0, gradient_checkpointing=False,
        use_transformers_paged=paged,
    )  # fmt: skip
    rewards = [exact_match("answer"), partial_match("answer")]
    for function, name in zip(rewards, ("exact_match", "partial_match")):
        function.__name__ = name
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=rewards, args=config, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model, padding_side="left"), callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    steady = range(1, len(ends))  # steps 2..N: the time since the previous step's end
    print(json.dumps({
        "steps": len(steady),
        "tokens": sum(lengths[i] * COMPLETIONS_PER_STEP for i in steady),
        "seconds": sum(ends[i] - ends[i - 1] for i in steady),
    }))  # fmt: skip


def trl(trl_python: str, model: str, steps: int, output_dir: Path, backend: str = "generate") -> dict:
    command = [trl_python, __file__, "--trl-child", "--model", model, "--steps", str(steps), "--out", str(output_dir)]
    command += ["--trl-paged"] if backend == "paged" else []
    result = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/demo_reverse_partial", help="the start model (a folder)")
    parser.add_argument("--trl-python", help="a Python with trl installed (its own venv)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--backends", nargs="+", default=["generate"],
        help="generation on both sides: generate (ours and TRL's plain generate) and/or paged (ours: "
        "generation_backend paged; TRL: use_transformers_paged). With both, each side's best is compared too",
    )  # fmt: skip
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-paged", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.model, args.steps, args.out, paged=args.trl_paged)
        return
    if not args.trl_python:
        parser.error("--trl-python is required: a Python whose environment has trl (see the docstring)")
    model = str(Path(args.model).resolve())
    speeds = {(side, backend): [] for side in ("ours", "TRL") for backend in args.backends}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            for backend in args.backends if index % 2 == 0 else args.backends[::-1]:
                mine = ours(model, args.steps, Path(scratch) / f"ours{index}{backend}", backend)
                theirs = trl(args.trl_python, model, args.steps, Path(scratch) / f"trl{index}{backend}", backend)
                speeds["ours", backend].append(mine["tokens"] / mine["seconds"])
                speeds["TRL", backend].append(theirs["tokens"] / theirs["seconds"])
                print(f"round {index + 1}, {backend}: ours {speeds['ours', backend][-1]:.0f} completion tokens/s "
                      f"({mine['tokens']} in {mine['seconds']:.1f} s), TRL {speeds['TRL', backend][-1]:.0f} "
                      f"({theirs['tokens']:.0f} in {theirs['seconds']:.1f} s)", flush=True)  # fmt: skip
    for backend in args.backends:
        ratios = [a / b for a, b in zip(speeds["ours", backend], speeds["TRL", backend])]
        print(
            f"{backend}: ours / TRL median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    best = {side: max((m, b) for (s, b), m in medians.items() if s == side) for side in ("ours", "TRL")}
    print(f"best against best: ours {best['ours'][1]} {best['ours'][0]:.0f} tokens/s, TRL {best['TRL'][1]} "
          f"{best['TRL'][0]:.0f}: {best['ours'][0] / best['TRL'][0]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
