"""The environment of the tool-calling demo (recipes/configs/grpo/demo_lookup_tools.yaml): made-up words and their
codes, which the model can only learn by asking (demo/tools/lookup_table.json, written by demo/make_tool_assets.py).
Each completion gets its own instance, reset with its data row: it holds the word asked about, so `lookup` takes no
argument (a tiny model copies a word forty tokens back poorly; this keeps the demo about calling the tool)."""

from __future__ import annotations

import json
from pathlib import Path

TABLE = json.loads(Path(__file__).with_name("lookup_table.json").read_text())


class Lookup:
    def reset(self, word: str, **row) -> None:
        self.word = word

    def lookup(self) -> str:
        """Looks up the code of the word the user asks about."""
        if self.word not in TABLE:
            raise KeyError(f"no code for {self.word!r}")
        return TABLE[self.word]
