"""A few of a generation round's completions, with their prompts, rewards and advantages, kept for the next logging
step: appended to `completions.jsonl` in the run's folder, and shown by the trackers that display tables (a wandb
or ClearML table, TensorBoard's text tab as a markdown table). Rank 0's slots only: the round's first completions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("step", "prompt", "completion", "reward", "advantage")


def prompt_text(prompt: Any) -> str:
    """A prompt as one line of text: chat turns as `role: content` joined by ` | `."""
    if isinstance(prompt, list):
        return " | ".join(f"{turn.get('role', '?')}: {turn.get('content', '')}" for turn in prompt)
    return str(prompt)


def markdown_table(rows: list[dict]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else prompt_text(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[column]) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


class CompletionLog:
    """`keep` the latest round's examples (every rank may call it; only the main process keeps any); `write(step)` at
    a logging step writes what was kept since the last write, once."""

    def __init__(self, accelerator, output_dir: str | Path, *, count: int):
        self.accelerator, self.path, self.count = accelerator, Path(output_dir) / "completions.jsonl", count
        self.pending: list[dict] = []

    def keep(self, step: int, prompts: list, completions: list[str], rewards, advantages) -> None:
        if not self.accelerator.is_main_process:
            return
        shown = min(self.count, len(completions))
        self.pending = [
            {"step": step, "prompt": prompts[i], "completion": completions[i], "reward": float(rewards[i]),
             "advantage": float(advantages[i])}
            for i in range(shown)
        ]  # fmt: skip

    def write(self, step: int) -> None:
        if not self.pending:
            return
        with open(self.path, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in self.pending)
        for tracker in self.accelerator.trackers:
            if hasattr(tracker, "log_table"):  # wandb, ClearML
                rows = [[row[c] if c != "prompt" else prompt_text(row[c]) for c in COLUMNS] for row in self.pending]
                tracker.log_table("completions", columns=list(COLUMNS), data=rows, step=step)
            elif tracker.name == "tensorboard":
                tracker.writer.add_text("completions", markdown_table(self.pending), global_step=step)
        self.pending = []
