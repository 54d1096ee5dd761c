#!/usr/bin/env python
"""The demo sets made from the SFT demo's string-reversal data: DPO and reward pairs, distillation's cut answers.

All deterministic and local. Each DPO pair answers one `reverse: ...` prompt twice: `chosen` is the reversed string,
`rejected` a plausible mistake (two neighbouring letters swapped, one letter dropped, one repeated, or the string left
as it was). Conversational explicit-prompt format:

    {"prompt": [{"role": "user", "content": "reverse: abc"}],
     "chosen": [{"role": "assistant", "content": "cba"}],
     "rejected": [{"role": "assistant", "content": "bca"}]}

The reward-model demo's pairs (`--reward-out-dir`, demo/assets/reverse_reward) are a larger set made the same way: a
reward model learns from one score per answer, not DPO's per-token log-probabilities, and on the DPO set's 2,000 pairs
it memorises the swapped-letter pairs instead of learning to check each letter against the prompt (held-out accuracy
stops near 0.84; docs/reward-and-distillation.md). So every one of the 4,000 training strings gets 8 near misses
(a draw that repeats one of that string's earlier near misses is redrawn, up to 10 times): 32,000 pairs, shuffled,
stored gzipped (`train.jsonl.gz`, which `datasets` reads as it is). Its `test.jsonl` is the DPO set's 200 held-out
pairs, so the two demos' held-out figures are on the same pairs.

The distillation demo's data (`--cut-out-dir`, demo/assets/reverse_cut) is the SFT demo's data as a generation budget
would leave it: each answer longer than 6 letters is cut to its first 6 with probability 0.6 (the chat template still
closes the turn), in the SFT format (`messages`); its `test.jsonl` is the SFT demo's 200 held-out strings, answers
whole. Plain SFT learns to stop after 6 letters; a student distilled from the SFT demo's model learns the teacher's
next token at each position instead, which after 6 letters of a longer string is its 7th letter
(docs/reward-and-distillation.md).

Usage::

    python demo/make_preference_assets.py [--source demo/assets/reverse] [--out-dir demo/assets/reverse_preferences] \
        [--reward-out-dir demo/assets/reverse_reward] [--cut-out-dir demo/assets/reverse_cut]
"""

from __future__ import annotations

import argparse
import gzip
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


def reward_pairs(source: Path, seed: int, near_misses: int) -> list[dict]:
    """Every string of `source` with `near_misses` near misses (as `mistake` draws them, redrawn when one repeats),
    shuffled."""
    rng = random.Random(seed)
    records = []
    for line in source.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        original = user["content"].removeprefix("reverse: ")
        drawn: set[str] = set()
        for _ in range(near_misses):
            for _ in range(10):
                wrong = mistake(assistant["content"], original, rng)
                if wrong not in drawn:
                    break
            drawn.add(wrong)
            records.append(
                {"prompt": [user], "chosen": [assistant], "rejected": [{"role": "assistant", "content": wrong}]}
            )
    rng.shuffle(records)
    return records


def cut_answers(source: Path, seed: int, keep: int, rate: float) -> list[dict]:
    """The chat examples of `source` in order, each answer longer than `keep` letters cut to its first `keep` with
    probability `rate`."""
    rng = random.Random(seed)
    records = []
    for line in source.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        if len(assistant["content"]) > keep and rng.random() < rate:
            assistant = {"role": "assistant", "content": assistant["content"][:keep]}
        records.append({"messages": [user, assistant]})
    return records


def as_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).parent / "assets" / "reverse")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "assets" / "reverse_preferences")
    parser.add_argument("--reward-out-dir", type=Path, default=Path(__file__).parent / "assets" / "reverse_reward")
    parser.add_argument("--cut-out-dir", type=Path, default=Path(__file__).parent / "assets" / "reverse_cut")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, seed, limit in (("train", 0, 2000), ("test", 1, 200)):
        records = pairs(args.source / f"{split}.jsonl", seed)[:limit]
        (args.out_dir / f"{split}.jsonl").write_text(as_jsonl(records))
        print(f"{args.out_dir / f'{split}.jsonl'}: {len(records)} pairs")
    args.reward_out_dir.mkdir(parents=True, exist_ok=True)
    records = reward_pairs(args.source / "train.jsonl", seed=0, near_misses=8)
    # mtime=0: the same bytes on every rebuild
    (args.reward_out_dir / "train.jsonl.gz").write_bytes(gzip.compress(as_jsonl(records).encode(), mtime=0))
    (args.reward_out_dir / "test.jsonl").write_text((args.out_dir / "test.jsonl").read_text())
    print(f"{args.reward_out_dir / 'train.jsonl.gz'}: {len(records)} pairs; test.jsonl: the {args.out_dir.name} ones")
    args.cut_out_dir.mkdir(parents=True, exist_ok=True)
    records = cut_answers(args.source / "train.jsonl", seed=2, keep=6, rate=0.6)
    (args.cut_out_dir / "train.jsonl").write_text(as_jsonl(records))
    (args.cut_out_dir / "test.jsonl").write_text((args.source / "test.jsonl").read_text())
    cut = sum(
        len(r["messages"][1]["content"]) < len(r["messages"][0]["content"].removeprefix("reverse: ")) for r in records
    )
    print(f"{args.cut_out_dir / 'train.jsonl'}: {len(records)} examples, {cut} answers cut to 6 letters")


if __name__ == "__main__":
    main()
