"""recipes/sft.py against TRL's SFTTrainer on the same tiny vision-language model and pictures, on CPU: the losses of
the first steps and the speed (issue 66's measure).

    PYTHONPATH=/path/to/trl python benchmarks/vision_sft_vs_trl.py [--rows 16] [--steps 12] [--rounds 3]

TRL is not a dependency of this repo: install it in a folder of its own (`pip install --no-deps --target DIR
trl==1.16.0`) and put that on PYTHONPATH. What both get:
- one pretrained-like folder: the vision demo's Llava (demo/tiny_llava.json) initialised with seed 0, and its
  processor (demo/assets/shapes_processor);
- the first --rows shapes pictures in TRL's prompt/completion vision layout (a user turn with an image part, the
  assistant's answer), loss on the completion only: TRL's default for prompt/completion data (for `messages` data its
  vision collator trains on every token, the pictures' own tokens included);
- every step the same batch: all --rows pictures (--rows per step, so each step is an epoch and the row order cannot
  differ), AdamW at a constant 1e-3 with gradient clipping at 1.0, fp32, one process, no packing.

The losses of the first --steps steps are compared one by one. Speed is the median step time after the first two
(start-up), as each trainer measures it: the recipe's logged `step_time_s`, TRL's time between `on_step_end` calls.
With --rounds the two alternate in fresh processes and the figure is the median of the rounds' speed ratios. One JSON
object is printed last, after "== report".
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
SHAPES = REPO / "demo" / "assets" / "shapes"


def prepare(folder: Path, rows: int) -> tuple[Path, Path]:
    """The model folder and the prompt/completion data (absolute image paths)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    model = folder / "model"
    AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(REPO / "demo" / "tiny_llava.json")
    ).save_pretrained(model)
    AutoProcessor.from_pretrained(REPO / "demo" / "assets" / "shapes_processor").save_pretrained(model)
    data = folder / "data"
    data.mkdir()
    lines = []
    for line in (SHAPES / "train.jsonl").read_text().splitlines()[:rows]:
        row = json.loads(line)
        lines.append({
            "images": [str((SHAPES / path).resolve()) for path in row["images"]],
            "prompt": row["messages"][:1], "completion": row["messages"][1:],
        })  # fmt: skip
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    return model, data


def recipe_run(model: Path, data: Path, out: Path, args) -> dict:
    command = [
        sys.executable, str(REPO / "recipes" / "sft.py"), "--model_name_or_path", str(model), "--dataset_name",
        str(data), "--output_dir", str(out), "--max_length", "80", "--packing", "false", "--per_device_train_batch_size",
        str(args.rows), "--max_steps", str(args.steps), "--learning_rate", "1e-3", "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--logging_steps", "1", "--report_to", "none", "--eval_split_size", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in logged if "loss" in record and "step_time_s" in record]
    return {"losses": [r["loss"] for r in steps], "step_times": [r["step_time_s"] for r in steps]}


def trl_run(model: Path, data: Path, out: Path, args) -> dict:
    command = [sys.executable, __file__, "--trl-only", str(model), str(data), str(out), "--rows", str(args.rows),
               "--steps", str(args.steps)]  # fmt: skip
    result = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads(result.stdout[result.stdout.rindex("== report") + len("== report") :])


def trl_only(model: Path, data: Path, out: Path, args) -> None:
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dataset = datasets.load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    dataset = dataset.cast_column("images", datasets.Sequence(datasets.Image()))
    times, losses = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = SFTConfig(
        output_dir=str(out), max_length=80, packing=False, per_device_train_batch_size=args.rows,
        max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        report_to="none", save_strategy="no", bf16=False, use_cpu=True, seed=42, dataloader_drop_last=False,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=AutoModelForImageTextToText.from_pretrained(model), args=config, train_dataset=dataset,
        processing_class=AutoProcessor.from_pretrained(model), callbacks=[Clock()],
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.train()
    import trl

    steps = [b - a for a, b in zip(times, times[1:])]
    print("== report " + json.dumps({"losses": losses, "step_times": steps, "trl": trl.__version__}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="pictures per step (all the data: one epoch a step)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trl-only", nargs=3, metavar=("MODEL", "DATA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_only:
        return trl_only(*(Path(p) for p in args.trl_only), args)
    ratios, rounds = [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model, data = prepare(folder, args.rows)
        for index in range(args.rounds):
            ours = recipe_run(model, data, folder / f"ours{index}", args)
            theirs = trl_run(model, data, folder / f"trl{index}", args)
            speeds = [statistics.median(run["step_times"][2:]) for run in (ours, theirs)]
            ratios.append(speeds[1] / speeds[0])  # > 1: the recipe is faster
            rounds.append({"recipe_step_s": round(speeds[0], 4), "trl_step_s": round(speeds[1], 4),
                           "recipe_speed_over_trl": round(ratios[-1], 3)})  # fmt: skip
            print(f"round {index + 1}: recipe {speeds[0] * 1000:.1f} ms/step, TRL {speeds[1] * 1000:.1f}, "
                  f"speed ratio {ratios[-1]:.2f}", flush=True)  # fmt: skip
    losses = list(zip(ours["losses"], theirs["losses"]))
    for step, (a, b) in enumerate(losses, 1):
        print(f"step {step}: recipe loss {a:.6f}, TRL {b:.6f}")
    report = {"median_speed_ratio": round(statistics.median(ratios), 3), "rounds": rounds, "losses": losses,
              "trl": theirs["trl"]}  # fmt: skip
    print("== report " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
