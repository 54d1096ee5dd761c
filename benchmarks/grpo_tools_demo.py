"""The tool-calling demo's held-out reward, before and after GRPO: the 200 unseen words' prompts
(demo/assets/lookup_prompts/test.jsonl) answered through the recipe's own tool loop (`tools.generate_with_tools`, one
round of calls, temperature 1e-4: greedy; one environment per prompt, reset with its row), each scored 1 when the final reply is the word's code (what the recipe's
exact_match reward gives); with the share of answers that called the tool and the share of calls that failed.

    python benchmarks/grpo_tools_demo.py --before outputs/demo_lookup_sft --after outputs/demo_lookup_grpo/latest
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "demo" / "assets" / "lookup_prompts" / "test.jsonl"
ENVIRONMENT = f"{REPO}/demo/tools/lookup.py:Lookup"


def evaluate(folder: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.methods.grpo import prompts, tools
    from fsdp_recipes.train.generation import GenerationSettings

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = (REPO / "demo" / "chat_templates" / "tools.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    environment = tools.load_environment(ENVIRONMENT)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    ids = [prompts.tokenize_prompt(row["prompt"], tokenizer, [t.schema for t in environment.tools]) for row in rows]
    _, row_tools = environment.start(rows, [None] * len(rows))
    settings = GenerationSettings(80, temperature=1e-4, batch_size=50, seed=0)
    rolled = tools.generate_with_tools(
        model, tokenizer, ids, list(range(len(ids))), settings, environment.tools, max_iterations=1, timeout=5,
        synced_gpus=False, row_tools=row_tools,
    )  # fmt: skip
    replies = [conversation[-1]["content"].strip() for conversation in rolled.conversations]
    calls = sum(c for c, _ in rolled.tool_calls)
    return {
        "reward": sum(r == row["answer"] for r, row in zip(replies, rows)) / len(rows),
        "called_the_tool": sum(c > 0 for c, _ in rolled.tool_calls) / len(rows),
        "failed_calls": sum(f for _, f in rolled.tool_calls) / max(calls, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the SFT warm start's folder")
    parser.add_argument("--after", required=True, help="the GRPO run's exported folder")
    args = parser.parse_args()
    report = {"before": evaluate(args.before), "after": evaluate(args.after)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
