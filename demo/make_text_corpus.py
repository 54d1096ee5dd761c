#!/usr/bin/env python
"""Generate the tiny raw-text corpus of the pretraining demo (deterministic, no network access needed).

Writes ``text/train-0000{0..3}-of-00004.jsonl`` and ``text/test.jsonl`` under demo/assets: short made-up stories,
one document per line as ``{"text": ...}``, from a small grammar a 0.5M-parameter character-level model can learn a
good part of in a few CPU minutes. Four train shards, so that 2 (or 4) processes each read whole shards.

Usage::

    python demo/make_text_corpus.py [--out demo/assets/text]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "June", "Kai", "Lena", "Milo", "Nora"]
ANIMALS = ["cat", "dog", "fox", "owl", "frog", "duck", "goat", "hen", "mouse", "bear"]
COLOURS = ["red", "blue", "green", "yellow", "brown", "white", "black", "grey"]
PLACES = ["the river", "the hill", "the old barn", "the garden", "the forest", "the market", "the lake", "the school"]
THINGS = ["a kite", "a ball", "a hat", "a book", "a cake", "a lamp", "a boat", "a map", "a key", "a drum"]
FEELINGS = ["happy", "sad", "tired", "proud", "scared", "hungry", "sleepy", "brave"]
TIMES = ["One morning", "One day", "Last winter", "At night", "In the spring", "After lunch"]

SEED = 2024
TRAIN_DOCUMENTS = 640
TEST_DOCUMENTS = 40
SHARDS = 4


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, colour, place, thing = rng.choice(ANIMALS), rng.choice(COLOURS), rng.choice(PLACES), rng.choice(THINGS)
    sentences = [f"{rng.choice(TIMES)}, {name} had a {colour} {animal}."]
    for _ in range(rng.randint(2, 5)):
        sentences.append(
            rng.choice(
                [
                    f"The {animal} went to {place} with {friend}.",
                    f"{name} found {thing} near {place}.",
                    f'{friend} said, "I like your {colour} {animal}."',
                    f"The {animal} was {rng.choice(FEELINGS)}, so {name} gave it {thing}.",
                    f"{name} and {friend} counted {rng.randint(2, 9)} {animal}s at {place}.",
                    f"It was {rng.choice(FEELINGS)} and sat by {place} until dark.",
                ]
            )
        )
    sentences.append(f"The end. {name} was {rng.choice(FEELINGS)}.")
    return " ".join(sentences)


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "assets" / "text")
    args = parser.parse_args()
    rng = random.Random(SEED)
    stories = [story(rng) for _ in range(TRAIN_DOCUMENTS + TEST_DOCUMENTS)]
    args.out.mkdir(parents=True, exist_ok=True)
    train = stories[:TRAIN_DOCUMENTS]
    for shard in range(SHARDS):
        write_jsonl(args.out / f"train-{shard:05d}-of-{SHARDS:05d}.jsonl", train[shard::SHARDS])
    write_jsonl(args.out / "test.jsonl", stories[TRAIN_DOCUMENTS:])
    print(
        f"wrote {TRAIN_DOCUMENTS} training stories in {SHARDS} shards and {TEST_DOCUMENTS} held-out ones to {args.out}"
    )


if __name__ == "__main__":
    main()
