"""A scripted policy for GRPO's tool calling (the tests' tiny models never write a tool call on their own): on the
string-reversal prompts its first turn calls the `reverse` tool on the prompt's string, and a turn that follows a tool
result answers with that result. `scripted_generation` replaces `fsdp_recipes.train.generation.generate_completions`;
with `run_model` the model's own generation still runs first (every collective of a real rollout happens, so ranks
must stay in step as they would) and only its tokens are replaced. `always_call`: every turn calls the tool again
(for the iteration bound); `direct_on_short`: strings of up to 3 letters are answered without the tool, so the
ranks of a launch have different numbers of completions to resume (their padding to stay in step is then used). The tools file is here too; the chat template that renders tools is the tool demo's."""

from __future__ import annotations

import contextlib
import json
import re

from helpers.paths import REPO

TOOLS_FILE = '''
def reverse(text: str) -> str:
    """Reverses a string.

    Args:
        text: the string to reverse
    """
    if text.startswith("q"):
        raise ValueError("strings starting with q are not supported")
    return text[::-1]


def undocumented(text):
    return text
'''

CONVERSATION_REWARD = '''
def used_the_tool(prompts, completions, **columns):
    """1.0 for a completion that is an assistant turn with a tool call, the tool's answer, then a reply."""
    return [
        float(len(c) == 3 and bool(c[0].get("tool_calls")) and c[1]["role"] == "tool" and c[2]["role"] == "assistant")
        for c in completions
    ]
'''

TOOLS_TEMPLATE = (REPO / "demo" / "chat_templates" / "tools.jinja").read_text().strip()  # the tool demo's template


def scripted_turn(prompt_text: str, *, always_call: bool, direct_on_short: bool = False) -> str:
    results = re.findall(r"result: (.*?)<\|end\|>", prompt_text)
    if results and not always_call:
        return results[-1]
    target = re.findall(r"reverse: (.*?)<\|end\|>", prompt_text)
    if direct_on_short and target and len(target[-1]) <= 3:  # answered without the tool: ranks call unevenly
        return target[-1][::-1]
    return (
        "<tool_call>"
        + json.dumps({"name": "reverse", "arguments": {"text": target[-1] if target else ""}})
        + ("</tool_call>")
    )


@contextlib.contextmanager
def scripted_generation(*, run_model: bool = True, always_call: bool = False, direct_on_short: bool = False):
    from fsdp_recipes.train import generation

    real = generation.generate_completions

    def generate(model, tokenizer, prompt_ids, keys, settings, *, synced_gpus, images=None):
        if run_model:
            real(model, tokenizer, prompt_ids, keys, settings, synced_gpus=synced_gpus)
        completions, truncated = [], []
        for prompt in prompt_ids:
            text = scripted_turn(tokenizer.decode(prompt), always_call=always_call, direct_on_short=direct_on_short)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            completions.append(ids[: settings.max_completion_length])
            truncated.append(len(ids) > settings.max_completion_length)
        return generation.Generated(completions, truncated)

    generation.generate_completions = generate
    try:
        yield
    finally:
        generation.generate_completions = real
