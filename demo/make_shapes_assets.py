#!/usr/bin/env python
"""Generate the vision demo's assets: coloured shapes, "which shape and colour?", and a tiny Llava to learn them.

Writes (deterministically, no network access needed):

* ``shapes_images/*.png`` -- 32x32 pictures of one shape (circle, square, triangle) in one colour (red, green, blue,
  yellow) at a random place and size on a white ground;
* ``shapes/train.jsonl`` / ``shapes/test.jsonl`` -- TRL's vision format: ``{"images": ["../shapes_images/train-0000.png"],
  "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which shape and colour?"}]},
  {"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]}``, image paths relative to the data
  files' folder (the pictures sit beside it: in it, `datasets` would read the folder as an image folder);
* ``shapes_prompts/train.jsonl`` / ``test.jsonl`` -- the same pictures as GRPO prompts: ``{"images": [...],
  "prompt": [the user turn], "answer": "red circle"}`` (the GRPO demo's exact_match reward reads ``answer``);
* ``shapes_processor/`` -- the processor of a Llava model: the SFT demo's character-level tokenizer with an
  ``<image>`` token and a chat template that renders image parts, and a CLIP image processor at 32x32;
* ``../tiny_llava.json`` -- the model's config: a 2-layer CLIP vision tower (8x8 patches: 16 image tokens per
  picture) and the SFT demo's 3-layer Llama.

Usage::

    python demo/make_shapes_assets.py [--out-dir demo/assets]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
QUESTION = "which shape and colour?"
IMAGE_TOKEN = "<image>"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def draw(shape: str, colour: str, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    side = rng.randint(14, 26)
    left, top = rng.randint(1, SIZE - side - 1), rng.randint(1, SIZE - side - 1)
    box = [left, top, left + side, top + side]
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(left + side / 2, top), (left, top + side), (left + side, top + side)], fill=fill)
    return image


def examples(split: str, count: int, pictures: Path, rng: random.Random) -> list[dict]:
    rows = []
    for index in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        name = f"{split}-{index:04d}.png"
        draw(shape, colour, rng).save(pictures / name, optimize=True)
        rows.append(
            {
                "images": [f"../{pictures.name}/{name}"],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"{colour} {shape}"}]},
                ],
            }
        )
    return rows


def write_processor(out: Path, tokenizer_folder: Path) -> None:
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(out)


def write_model_config(path: Path, text_config: Path, image_token_id: int) -> None:
    text = json.loads(text_config.read_text())
    text["vocab_size"] = image_token_id + 1
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "tie_word_embeddings": True,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": SIZE,
            "patch_size": 8,
            "projection_dim": 64,
        },
    }
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "assets"))
    parser.add_argument("--no-model-config", action="store_true", help="leave demo/tiny_llava.json as it is")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    folder, pictures = out / "shapes", out / "shapes_images"
    folder.mkdir(parents=True, exist_ok=True)
    pictures.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, count in (("train", 1200), ("test", 120)):
        rows = examples(split, count, pictures, rng)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        prompts = [
            {"images": row["images"], "prompt": row["messages"][:1], "answer": row["messages"][1]["content"][0]["text"]}
            for row in rows
        ]
        (out / "shapes_prompts").mkdir(exist_ok=True)
        (out / "shapes_prompts" / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    write_processor(out / "shapes_processor", out / "tokenizer")
    from transformers import AutoTokenizer

    image_token_id = AutoTokenizer.from_pretrained(out / "shapes_processor").convert_tokens_to_ids(IMAGE_TOKEN)
    if not args.no_model_config:
        write_model_config(
            Path(__file__).parent / "tiny_llava.json", Path(__file__).parent / "tiny_llama.json", image_token_id
        )
    print(
        f"wrote {folder}, {pictures} (1,200 train and 120 test pictures), {out / 'shapes_processor'}, demo/tiny_llava.json"
    )


if __name__ == "__main__":
    main()
