"""The vision demo's data and model for tests: a subset of its pictures that can move, the SFT values of a tiny
Llava run, and a pretrained-like Llava folder (weights and processor)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.paths import REPO

SHAPES = REPO / "demo" / "assets" / "shapes"
PROCESSOR = REPO / "demo" / "assets" / "shapes_processor"
LLAVA = REPO / "demo" / "tiny_llava.json"


def shapes_subset(folder: Path, count: int = 24, text_only: int = 0) -> Path:
    """The demo's first pictures (`count` to train on, 8 held out), their paths made absolute (the rows move); the
    last `text_only` training rows ask about a colour's name with no picture (data that mixes both)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        lines = (SHAPES / f"{split}.jsonl").read_text().splitlines()[: count if split == "train" else 8]
        rows = [json.loads(line) for line in lines]
        for index, row in enumerate(rows):
            row["images"] = [str((SHAPES / path).resolve()) for path in row["images"]]
            if split == "train" and index >= count - text_only:
                row["images"] = []
                row["messages"][0]["content"] = [{"type": "text", "text": f"name colour {index}"}]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def vision_values(data: Path, output_dir: Path, **overrides) -> dict:
    values = dict(
        model_config=str(LLAVA), tokenizer_name_or_path=str(PROCESSOR), dataset_name=str(data), max_length=80,
        packing=False, max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1,
        output_dir=str(output_dir), seed=7, report_to="none",
    )  # fmt: skip
    return {**values, **overrides}


def vision_dpo_values(pairs: Path, output_dir: Path, **overrides) -> dict:
    """DPO on `shapes_pairs`: the SFT values without packing (DPO never packs), at a rate that moves a tiny model."""
    values = {key: value for key, value in vision_values(pairs, output_dir).items() if key != "packing"}
    return {**values, "learning_rate": 1e-3, **overrides}


def llava_folder(folder: Path) -> Path:
    """A pretrained-like tiny Llava folder: weights and processor, as a Hub repo holds them."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA)).save_pretrained(folder)
    AutoProcessor.from_pretrained(PROCESSOR).save_pretrained(folder)
    return folder


def shapes_pairs(folder: Path, count: int = 24) -> Path:
    """The demo's pictures as preference pairs in TRL's vision format: the question and its picture as the prompt,
    the right answer chosen and another picture's answer rejected."""
    subset = shapes_subset(folder.with_name(f"{folder.name}_rows"), count)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (subset / f"{split}.jsonl").read_text().splitlines()]
        answers = [row["messages"][1]["content"][0]["text"] for row in rows]
        pairs = []
        for index, row in enumerate(rows):
            wrong = next(a for a in answers[index + 1 :] + answers[:index] if a != answers[index])
            pairs.append({
                "images": row["images"], "prompt": row["messages"][:1], "chosen": row["messages"][1:],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
            })  # fmt: skip
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return folder


# A reward that looks at the prompts' pictures (PIL images, as TRL gives them) and notes what it was given.
PICTURE_REWARD = """
import json
from pathlib import Path


def brightness(prompts, completions, images, **columns):
    with open(Path(__file__).with_name("seen.jsonl"), "a") as seen:
        seen.write(json.dumps([[type(image).__name__, image.size] for row in images for image in row]) + "\\n")
    return [sum(row[0].convert("L").getdata()) / (255.0 * row[0].width * row[0].height) for row in images]
"""


def shapes_prompts(folder: Path, count: int = 24) -> Path:
    """The demo's pictures as GRPO prompts: the question and its picture as chat turns, the `answer` beside them,
    and `pictures.py:brightness` (PICTURE_REWARD)."""
    subset = shapes_subset(folder.with_name(f"{folder.name}_rows"), count)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (subset / "train.jsonl").read_text().splitlines()]
    prompts = [
        {"images": row["images"], "prompt": row["messages"][:1], "answer": row["messages"][1]["content"][0]["text"]}
        for row in rows
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))
    (folder / "pictures.py").write_text(PICTURE_REWARD)
    return folder


def vision_grpo_values(prompts: Path, output_dir: Path, **overrides) -> dict:
    """GRPO on `shapes_prompts`: 8 completions a step (2 prompts x 4), rewarded by the exact answer and brightness."""
    values = dict(
        model_config=str(LLAVA), tokenizer_name_or_path=str(PROCESSOR), dataset_name=str(prompts), max_length=48,
        max_completion_length=4, num_generations=4, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=None, seed=7,
        report_to="none", reward_funcs=["exact_match", f"{prompts / 'pictures.py'}:brightness"], beta=0.05,
        output_dir=str(output_dir),
    )  # fmt: skip
    return {**values, **overrides}
