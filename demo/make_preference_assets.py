#!/usr/bin/env python
"""Preference pairs for the DPO demo, made from the SFT demo's string-reversal data (deterministic, local).

Each pair answers one `reverse: ...` prompt twice: `chosen` is the reversed string, `rejected` a plausible mistake
(two neighbouring letters swapped, one letter dropped, one repeated, or the string left as it was). Conversational
explicit-prompt format:

    {"prompt": [{"role": "user", "content": "reverse: abc"}],
     "chosen": [{"role": "assistant", "content": "cba"}],
     "rejected": [{"role": "assistant", "content": "bca"}]}

Usage::

    python demo/make_preference_assets.py [--source demo/assets/reverse] [--out-dir demo/assets/reverse_preferences]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def mistake(answer: str, original: str, rng: random.Random) -> str:
    """A wrong answer close to the right one: what an almost-trained model would get wrong."""
    for _ in range(20):
        kind = rng.choice(["swap", "drop", "repeat", "unreversed"])
        if kind == "swap" and len(answer) > 1:
            i = rng.randrange(len(answer) - 1)
            wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == "drop" and len(answer) > 1:
            i = rng.randrange(len(answer))
            wrong = answer[:i] + answer[i + 1 :]
        elif kind == "repeat":
            i = rng.randrange(len(answer))
            wrong = answer[:i] + answer[i] + answer[i:]
        else:
            wrong = original
        if wrong != answer:
            return wrong
    return answer + answer[-1]


def pairs(source: Path, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for line in source.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        original = user["content"].removeprefix("reverse: ")
        records.append(
            {
                "prompt": [user],
                "chosen": [assistant],
                "rejected": [{"role": "assistant", "content": mistake(assistant["content"], original, rng)}],
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).parent / "assets" / "reverse")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "assets" / "reverse_preferences")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, seed, limit in (("train", 0, 2000), ("test", 1, 200)):
        records = pairs(args.source / f"{split}.jsonl", seed)[:limit]
        (args.out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{args.out_dir / f'{split}.jsonl'}: {len(records)} pairs")


if __name__ == "__main__":
    main()
