"""Builds the tool-calling demo's assets: 1,200 made-up words and their codes (demo/tools/lookup_table.json), which
only the `lookup` tool of the demo's environment knows (demo/tools/lookup.py: the environment holds the word asked
about, so the call takes no argument); SFT transcripts showing the model how to call it (demo/assets/lookup_sft: the
user asks a word's code, the assistant calls `lookup`, the tool answers, the assistant gives the code); and GRPO
prompts with the code as `answer` and the `word` the environment is reset with (demo/assets/lookup_prompts). The 200
held-out words are in no training row, so a model can score on them only through the tool.

    python demo/make_tool_assets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO = Path(__file__).resolve().parent
LETTERS, CODE_LETTERS = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def main() -> None:
    rng = random.Random(0)
    words: dict[str, str] = {}
    while len(words) < 1200:
        words["".join(rng.choices(LETTERS, k=rng.randint(4, 6)))] = "".join(rng.choices(CODE_LETTERS, k=4))
    (DEMO / "tools" / "lookup_table.json").write_text(json.dumps(words, indent=0) + "\n")
    ordered = list(words.items())
    splits = {"train": ordered[:1000], "test": ordered[1000:]}
    for folder in ("lookup_sft", "lookup_prompts"):
        (DEMO / "assets" / folder).mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        sft, prompts = [], []
        for word, code in pairs:
            question = [{"role": "system", "content": "tools: lookup"}, {"role": "user", "content": f"code of {word}?"}]
            call = json.dumps({"name": "lookup", "arguments": {}})
            sft.append(
                {
                    "messages": question
                    + [
                        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                        {"role": "tool", "content": code},
                        {"role": "assistant", "content": code},
                    ]
                }
            )
            prompts.append({"prompt": question[1:], "answer": code, "word": word})  # GRPO shows the tools itself
        (DEMO / "assets" / "lookup_sft" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
        (DEMO / "assets" / "lookup_prompts" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in prompts)
        )


if __name__ == "__main__":
    main()
