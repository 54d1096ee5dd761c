"""The vision demo's data and model for tests: a subset of its pictures that can move, the SFT values of a tiny
Llava run, and a pretrained-like Llava folder (weights and processor)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.paths import REPO

SHAPES = REPO / "demo" / "assets" / "shapes"
PROCESSOR = REPO / "demo" / "assets" / "shapes_processor"
LLAVA = REPO / "demo" / "tiny_llava.json"


def shapes_subset(folder: Path, count: int = 24) -> Path:
    """The demo's first pictures (`count` to train on, 8 held out), their paths made absolute (the rows move)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        lines = (SHAPES / f"{split}.jsonl").read_text().splitlines()[: count if split == "train" else 8]
        rows = [json.loads(line) for line in lines]
        for row in rows:
            row["images"] = [str((SHAPES / path).resolve()) for path in row["images"]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def vision_values(data: Path, output_dir: Path, **overrides) -> dict:
    values = dict(
        model_config=str(LLAVA), tokenizer_name_or_path=str(PROCESSOR), dataset_name=str(data), max_length=80,
        packing=False, max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1,
        output_dir=str(output_dir), seed=7, report_to="none",
    )  # fmt: skip
    return {**values, **overrides}


def llava_folder(folder: Path) -> Path:
    """A pretrained-like tiny Llava folder: weights and processor, as a Hub repo holds them."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA)).save_pretrained(folder)
    AutoProcessor.from_pretrained(PROCESSOR).save_pretrained(folder)
    return folder
