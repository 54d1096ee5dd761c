"""Builds demo/assets/reverse_prompts (the GRPO demo's prompts) from demo/assets/reverse: each chat example becomes a
`prompt` (the user's turn, as chat turns) and an `answer` (the reversed string), the column the rewards compare with.

    python demo/make_prompt_assets.py
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def main() -> None:
    target = ASSETS / "reverse_prompts"
    target.mkdir(exist_ok=True)
    for split in ("train", "test"):
        lines = []
        for line in (ASSETS / "reverse" / f"{split}.jsonl").read_text().splitlines():
            user, assistant = json.loads(line)["messages"]
            lines.append(json.dumps({"prompt": [user], "answer": assistant["content"]}))
        (target / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
