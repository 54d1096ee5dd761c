"""Held-out exact match of a vision-language model folder on the shapes demo's test pictures (greedy answers), with
transformers alone: the figure the SFT and GRPO shapes demos report (docs/vision.md).

    python benchmarks/vision_exact_match.py outputs/demo_shapes_partial [outputs/demo_shapes_grpo ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

TEST = Path(__file__).resolve().parent.parent / "demo" / "assets" / "shapes_prompts" / "test.jsonl"


@torch.no_grad()
def exact_match(folder: str, batch_size: int = 40) -> float:
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor.tokenizer.padding_side = "left"
    rows = [json.loads(line) for line in TEST.read_text().splitlines()]
    right = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        texts = [processor.apply_chat_template(row["prompt"], add_generation_prompt=True) for row in chunk]
        pictures = [Image.open(TEST.parent / row["images"][0]).convert("RGB") for row in chunk]
        inputs = processor(text=texts, images=pictures, return_tensors="pt", padding=True)
        output = model.generate(**inputs, max_new_tokens=17, do_sample=False)
        answers = processor.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(answer.strip() == row["answer"] for answer, row in zip(answers, chunk))
    return right / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    for folder in parser.parse_args().folders:
        print(f"{folder}: held-out exact match {exact_match(folder):.1%} of 120 pictures")


if __name__ == "__main__":
    main()
