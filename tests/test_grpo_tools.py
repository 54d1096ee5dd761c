"""Tool calling in GRPO's rollouts (TRL's `tools`, `max_tool_calling_iterations`): calls parsed from the generated
text, run, and answered as text (a raising, unknown, mis-called or slow tool with its error: never a crash), the
answers appended as the chat template renders them and masked out of the loss, the iteration bound kept, the whole
exchange given to the reward functions; refused before loading when a tool cannot be described to the model or the
template ignores tools. The tests' tiny models write no tool calls, so a scripted policy does
(tests/helpers/scripted_tools.py); the same run under TP 2 equals one process in tests/test_tensor_parallel.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from fixtures.grpo import tool_run_values
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.methods.grpo import groups, rollouts, tools
from fsdp_recipes.train.generation import GenerationSettings
from helpers.paths import TOKENIZER
from helpers.recipes import read_metrics, recipe_error_in_process, run_recipe_in_process
from helpers.scripted_tools import CONVERSATION_REWARD, TOOLS_FILE, TOOLS_TEMPLATE, scripted_generation

ODD_TOOLS = '''
import sys


def leaves(code: int) -> str:
    """Exits.

    Args:
        code: the exit status
    """
    sys.exit(code)


def counts(text: str) -> dict:
    """Counts letters, answering with a dict (sent back as its str, as TRL does).

    Args:
        text: the text
    """
    return {"letters": len(text)}
'''


@pytest.fixture
def tool_files(tmp_path):
    (tmp_path / "my_tools.py").write_text(
        TOOLS_FILE
        + "\n\ndef slow(seconds: float) -> str:\n    '''Waits.\n\n    Args:\n        seconds: how long\n    '''\n    import time\n    time.sleep(seconds)\n    return 'done'\n"
    )
    (tmp_path / "my_rewards.py").write_text(CONVERSATION_REWARD)
    return tmp_path


@pytest.fixture
def tools_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def test_calls_are_parsed_run_and_every_failure_is_answered_as_text(tool_files):
    (tool_files / "odd_tools.py").write_text(ODD_TOOLS)
    specs = [f"{tool_files}/my_tools.py:{n}" for n in ("reverse", "slow")]
    specs += [f"{tool_files}/odd_tools.py:{n}" for n in ("leaves", "counts")]
    loaded = {tool.name: tool for tool in tools.load_tools(specs)}
    assert loaded["reverse"].schema["function"]["parameters"]["properties"]["text"]["type"] == "string"
    text = '<tool_call>{"name": "reverse", "arguments": {"text": "ab"}}</tool_call> and <tool_call>{oops}</tool_call>'
    assert tools.parse_tool_calls(text) == [{"name": "reverse", "arguments": {"text": "ab"}}]  # bad JSON: no call
    assert tools.run_call(loaded, {"name": "reverse", "arguments": {"text": "ab"}}, 5) == ("ba", False)
    answers = {
        "raises": tools.run_call(loaded, {"name": "reverse", "arguments": {"text": "qa"}}, 5),
        "unknown": tools.run_call(loaded, {"name": "search", "arguments": {}}, 5),
        "wrong arguments": tools.run_call(loaded, {"name": "reverse", "arguments": {"txt": "a"}}, 5),
    }
    assert answers["raises"] == ("error: ValueError: strings starting with q are not supported", True)
    assert answers["unknown"] == ("error: no tool named 'search' (tools: counts, leaves, reverse, slow)", True)
    assert answers["wrong arguments"][1] and answers["wrong arguments"][0].startswith("error: TypeError")
    started = time.monotonic()
    assert tools.run_call(loaded, {"name": "slow", "arguments": {"seconds": 5}}, 0.2) == (
        "error: slow did not return within 0.2 s",
        True,
    )
    assert time.monotonic() - started < 2  # the call is not waited for
    # and its thread cannot keep the process from exiting when the run ends (a joined worker would hang it)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("tool "))
    assert tools.run_call(loaded, {"name": "leaves", "arguments": {"code": 3}}, 5) == (
        "error: leaves called sys.exit(3); a tool must return its answer",
        True,
    )  # a rank that exited alone would leave the others waiting in a collective
    assert tools.run_call(loaded, {"name": "counts", "arguments": {"text": "abc"}}, 5) == ("{'letters': 3}", False)


def test_a_tool_the_model_cannot_be_told_about_or_a_template_without_tools_is_refused(tool_files, tools_tokenizer):
    from transformers import AutoTokenizer

    with pytest.raises(ConfigError, match="undocumented cannot be described to the model") as refused:
        tools.load_tools([f"{tool_files}/my_tools.py:undocumented"])
    assert "type hints and a docstring" in str(refused.value)
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        tools.load_tools([f"{tool_files}/my_tools.py:missing"])
    reverse = tools.load_tools([f"{tool_files}/my_tools.py:reverse"])
    assert "ignores `tools`" in tools.template_problem(AutoTokenizer.from_pretrained(TOKENIZER), reverse)
    assert tools.template_problem(tools_tokenizer, reverse) is None


def test_a_round_trip_masks_the_tool_messages_answers_failures_and_keeps_the_iteration_bound(
    tool_files, tools_tokenizer
):
    loaded = tools.load_tools([f"{tool_files}/my_tools.py:reverse"])
    prompts = [
        tools_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"reverse: {word}"}], tools=[loaded[0].schema], add_generation_prompt=True
        )["input_ids"]
        for word in ("abc", "qrs")
    ]
    settings = GenerationSettings(200, batch_size=2)
    with scripted_generation(run_model=False):
        rolled = tools.generate_with_tools(
            None, tools_tokenizer, prompts, [1, 2], settings, loaded, max_iterations=None, timeout=5, synced_gpus=False
        )
    first, second = rolled.conversations
    assert first[0]["tool_calls"][0]["function"] == {"name": "reverse", "arguments": {"text": "abc"}}
    assert first[1] == {"role": "tool", "name": "reverse", "content": "cba"} and first[2]["content"] == "cba"
    assert second[1]["content"].startswith("error: ValueError") and rolled.tool_calls == [(1, 0), (1, 1)]
    text = tools_tokenizer.decode(rolled.completion_ids[0])
    trained = tools_tokenizer.decode([t for t, m in zip(rolled.completion_ids[0], rolled.policy_masks[0]) if m])
    assert "result: cba" in text and "result" not in trained  # the tool's answer is in the row, not in the loss
    assert trained.startswith("<tool_call>") and trained.endswith("cba<|end|>")

    with scripted_generation(run_model=False, always_call=True):
        bounded = tools.generate_with_tools(
            None, tools_tokenizer, prompts[:1], [1], settings, loaded, max_iterations=2, timeout=5, synced_gpus=False
        )
    assert bounded.tool_calls == [(2, 0)] and [m["role"] for m in bounded.conversations[0]] == [
        "assistant", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert "<tool_call>" in bounded.conversations[0][-1]["content"]  # the third call is left unanswered


def test_the_round_trains_only_the_policys_tokens(tools_tokenizer):
    slots = groups.ScoredSlots(
        [0, 0], [[5, 6, 7, 8], [5, 6]], [False, False], torch.tensor([1.0, 0.0]), torch.zeros(2, 1),
        policy_masks=[[1, 0, 0, 1], [1, 1]], tool_calls=[(1, 0), (1, 1)],
    )  # fmt: skip
    micro, global_tokens, figures, _, _ = rollouts.assemble_round(
        slots, slots, [[3, 4]], rank=0, world_size=1, device="cpu", function_names=["r"], num_generations=2,
        scale_rewards="group", advantage_estimator="grpo", mask_truncated_completions=False, rows_per_micro_batch=2,
        pad_token_id=0, padding_free=False, kept_groups=1, generation_passes=1,
    )  # fmt: skip
    assert micro[0]["completion_mask"].tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]] and global_tokens == 4
    assert figures["tools/call_frequency"] == 1.0 and figures["tools/failure_frequency"] == 0.5
    assert figures["completions/mean_length"] == 2.0  # the policy's tokens


def test_grpo_with_a_tool_scores_the_exchange_logs_calls_and_failures_trains_and_resumes_exactly(
    tmp_path, tool_files, pretrained_tiny_model, prompt_data
):
    values = tool_run_values(
        tool_files, pretrained_tiny_model, prompt_data, tmp_path / "out", max_steps=4, save_steps=2,
        generation_backend="paged",  # the engine runs each round's continuation prompts (the script replaces its tokens)
    )  # fmt: skip
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000002"
    resumed = {**values, "output_dir": str(tmp_path / "resumed"), "resume_from_checkpoint": str(checkpoint)}
    with scripted_generation():
        run_recipe_in_process("grpo", tmp_path, "tools", values)
        run_recipe_in_process("grpo", tmp_path, "resumed", resumed)
    # the resumed run generates, calls, scores and trains what the uninterrupted one did
    after = {r["step"]: r for r in read_metrics(tmp_path / "out") if r.get("loss") is not None and r["step"] > 2}
    again = {r["step"]: r for r in read_metrics(tmp_path / "resumed") if r.get("loss") is not None}
    assert sorted(after) == sorted(again) == [3, 4]
    assert all(after[s]["loss"] == again[s]["loss"] for s in (3, 4))
    rounds = [row for row in read_metrics(tmp_path / "out") if "tools/call_frequency" in row]
    assert rounds and all(row["tools/call_frequency"] == 1.0 for row in rounds)
    for row in rounds:  # a failed call (strings starting with q) answers with its error, which is not the answer
        assert row["rewards/used_the_tool/mean"] == 1.0
        assert row["rewards/exact_match/mean"] == pytest.approx(1.0 - row["tools/failure_frequency"])
        assert row["loss"] == row["loss"]  # finite
    shown = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert shown and all("result: " in row["completion"] for row in shown)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_tool_calling_iterations": 0}, "max_tool_calling_iterations must be >= 1 or null, got 0"),
        ({"chat_template": None}, "tools: the tokenizer's chat template ignores `tools`"),
    ],
)
def test_bad_tool_settings_are_refused_before_loading(
    tmp_path, capsys, tool_files, pretrained_tiny_model, prompt_data, overrides, message
):
    values = tool_run_values(tool_files, pretrained_tiny_model, prompt_data, tmp_path / "out", **overrides)
    assert message in recipe_error_in_process("grpo", tmp_path, values, capsys)


ENVIRONMENT_REWARD = """
def saw_the_environments(prompts, completions, environments, **columns):
    return [float(type(e).__name__ == "Reversal" and e.reversed is not None) for e in environments]
"""


def test_an_environment_gives_each_completion_its_own_tools_and_its_reward(
    tmp_path, pretrained_tiny_model, prompt_data
):
    from fixtures.grpo import grpo_values
    from helpers.paths import REPO

    (tmp_path / "env_rewards.py").write_text(ENVIRONMENT_REWARD)
    values = grpo_values(
        pretrained_tiny_model, prompt_data, tmp_path / "out", chat_template=TOOLS_TEMPLATE, max_length=140,
        max_completion_length=100, environment_factory=f"{REPO}/demo/environments/reversal.py:Reversal",
        reward_funcs=[f"{tmp_path}/env_rewards.py:saw_the_environments"], reward_weights=None,
        generation_backend="static_compiled", torch_compile_backend="eager",  # tool rounds on a static cache
    )  # fmt: skip
    with scripted_generation():
        run_recipe_in_process("grpo", tmp_path, "environment", values)
    rounds = [row for row in read_metrics(tmp_path / "out") if "rewards/Reversal/mean" in row]
    assert rounds and all(row["rewards/Reversal/mean"] == 1.0 for row in rounds)  # the tool reversed the answer
    assert all(row["rewards/saw_the_environments/mean"] == 1.0 and row["reward"] == 2.0 for row in rounds)


def test_an_environment_without_reset_or_tools_is_refused(tmp_path):
    (tmp_path / "envs.py").write_text(
        "class NoReset:\n    def act(self, x: int) -> int:\n        '''Acts.\n\n        Args:\n            x: a number\n"
        "        '''\n        return x\n\n\nclass NoTools:\n    def reset(self, **row):\n        return None\n"
    )
    with pytest.raises(ConfigError, match="NoReset has no reset method"):
        tools.load_environment(f"{tmp_path}/envs.py:NoReset")
    with pytest.raises(ConfigError, match="NoTools has no public method"):
        tools.load_environment(f"{tmp_path}/envs.py:NoTools")


PICKY_ENVIRONMENT = '''
class Picky:
    def reset(self, **row):
        return row["level"]

    def act(self, x: int) -> int:
        """Acts.

        Args:
            x: a number
        """
        return x
'''


def test_an_environment_whose_reset_raises_is_refused_naming_the_prompt_before_loading(
    tmp_path, capsys, pretrained_tiny_model, prompt_data
):
    from fixtures.grpo import grpo_values

    (tmp_path / "envs.py").write_text(PICKY_ENVIRONMENT)
    values = grpo_values(
        pretrained_tiny_model, prompt_data, tmp_path / "out", chat_template=TOOLS_TEMPLATE, max_length=140,
        max_completion_length=100, environment_factory=f"{tmp_path}/envs.py:Picky",
    )  # fmt: skip
    error = recipe_error_in_process("grpo", tmp_path, values, capsys)
    assert "environment_factory: Picky.reset raised KeyError: 'level' on prompt 0 of the train split" in error
    assert not (tmp_path / "out" / "checkpoints").exists()
