#!/usr/bin/env python
"""Generate the tiny, fully local data set of the classification demo (deterministic, no network access needed).

Writes ``first_letter/train.jsonl`` (2,000 rows) and ``first_letter/test.jsonl`` (200 rows): random lowercase strings
of 4-10 letters, labelled by their first letter: ``{"text": "mqzia", "label": "mid"}`` with "low" (a-i), "mid" (j-r),
"high" (s-z). The label sits at the first token and a decoder classifier reads the last, so attention must carry it
across the string.

Usage::

    python demo/make_first_letter_assets.py [--out-dir demo/assets]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

CLASSES = ["low", "mid", "high"]


def example(rng: random.Random) -> dict:
    text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))
    return {"text": text, "label": CLASSES[string.ascii_lowercase.index(text[0]) * len(CLASSES) // 26]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "assets"))
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    folder = Path(args.out_dir) / "first_letter"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, count in (("train", 2000), ("test", 200)):
        rows = [example(rng) for _ in range(count)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
