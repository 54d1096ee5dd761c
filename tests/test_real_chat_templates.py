"""The published chat templates of the families users train (tests/helpers/real_templates.py: the templates as their
Hub repositories ship them, source and licence recorded there), on the demo tokenizer with each family's special
strings: what SFT trains, the prompt/answer split of DPO, KTO and reward, tool-call turns and inline reasoning,
GRPO's tool rounds, and the template an SFT run exports. Per family, what is trained is in docs/chat-templates.md."""

from __future__ import annotations

import copy
import json

import pytest
from datasets import Dataset

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.chat import tokenize_dataset
from fsdp_recipes.methods.grpo import rewards, tools
from fsdp_recipes.methods.preference import paired
from fsdp_recipes.train import generation
from fsdp_recipes.train.generation import GenerationSettings
from helpers.data import encode_chat, trained_text, write_jsonl, write_tiny_model_config
from helpers.real_templates import FAMILIES, family_tokenizer, template_text
from helpers.real_vocabularies import real_vocabulary_tokenizer
from helpers.recipes import base_recipe_values, run_recipe_in_process

CONVERSATION = [
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "reverse: xy"},
    {"role": "assistant", "content": "yx"},
]
# Each reply with what ends it, nothing of the prompt or of the headers the generation prompt already holds.
TRAINED = {
    "qwen3": "cba<|im_end|>\n<think>\n\n</think>\n\nyx<|im_end|>\n",  # the last reply as the model writes it
    "qwen2.5": "cba<|im_end|>\nyx<|im_end|>\n",
    "qwen2": "cba<|im_end|>\nyx<|im_end|>\n",
    "llama-3.1": "cba<|eot_id|>yx<|eot_id|>",
    "llama-3.2": "cba<|eot_id|>yx<|eot_id|>",
    "gemma-3": "cba<end_of_turn>\nyx<end_of_turn>\n",
    "mistral-small-3": "cba</s>yx</s>",
    "mistral-nemo": "cba</s>yx</s>",
    "smollm3": "cba<|im_end|>\nyx<|im_end|>\n",  # its {% generation %} blocks, less the header they also mark
    # harmony: an earlier final answer ends with <|end|> in history where the model wrote <|return|>: not trained
    "gpt-oss": "<|channel|>final<|message|>cba<|channel|>final<|message|>yx<|return|>",
    "deepseek-r1-distill": "cba<｜end▁of▁sentence｜>yx<｜end▁of▁sentence｜>",
    "phi-4": "cba<|im_end|>yx<|im_end|>",
    "phi-4-mini": "cba<|end|>yx<|end|><|endoftext|>",
}
CALL = {"type": "function", "id": "abc123XYZ", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}


def tool_conversation(content):
    return [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": content, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "abc123XYZ", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]


TOOL_TURNS_TRAINED = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    "<think>\n\n</think>\n\nIt is sunny.<|im_end|>\n",
    "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    "It is sunny.<|im_end|>\n",
    "llama-3.1": '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>It is sunny.<|eot_id|>',
    "llama-3.2": '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>It is sunny.<|eot_id|>',
    "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "abc123XYZ"}]</s>'
    "It is sunny.</s>",
    "gpt-oss": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    "<|channel|>final<|message|>It is sunny.<|return|>",
}


def sft_encode(tokenizer, example):
    return encode_chat(tokenizer, example, rewriting_templates=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_trains_each_reply_with_its_end_of_turn_token_and_nothing_else(family):
    tokenizer = family_tokenizer(family)
    encoded = sft_encode(tokenizer, {"messages": CONVERSATION})
    assert encoded["input_ids"] == tokenizer.apply_chat_template(CONVERSATION)["input_ids"]  # the model's own text
    assert tokenizer.convert_tokens_to_ids("<|unk|>") not in encoded["input_ids"]
    assert trained_text(tokenizer, encoded) == TRAINED[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dpo_kto_and_reward_split_prompt_and_answer_as_sft_trains_the_answer(family):
    """tokenize_side builds every side of DPO, KTO and reward: its answer tokens are SFT's for the same turns."""
    tokenizer = family_tokenizer(family)
    for prompt, answer in ((CONVERSATION[:1], CONVERSATION[1:2]), (CONVERSATION[:3], CONVERSATION[3:])):
        ids, mask = paired.tokenize_side(tokenizer, prompt, answer, max_length=1 << 20, max_prompt_length=None)
        sft = sft_encode(tokenizer, {"prompt": prompt, "completion": answer})
        assert (ids, mask) == (sft["input_ids"], sft["loss_mask"])
        assert answer[0]["content"] in trained_text(tokenizer, {"input_ids": ids, "loss_mask": mask})


@pytest.mark.parametrize("family", sorted(TOOL_TURNS_TRAINED))
def test_a_tool_call_turn_is_trained_with_its_end_token_whether_its_content_is_null_or_empty(family):
    tokenizer = family_tokenizer(family)
    for content in (None, ""):  # OpenAI-style rows write null
        encoded = sft_encode(tokenizer, {"messages": tool_conversation(content)})
        assert trained_text(tokenizer, encoded) == TOOL_TURNS_TRAINED[family]


@pytest.mark.parametrize("family", ["qwen2", "smollm3", "deepseek-r1-distill", "phi-4", "phi-4-mini"])
def test_a_template_that_drops_tool_calls_is_refused_naming_the_example_and_the_turn(family):
    data = Dataset.from_list([{"messages": CONVERSATION}, {"messages": tool_conversation(None)}])
    with pytest.raises(DataError) as refused:
        tokenize_dataset(data, family_tokenizer(family), assistant_only_loss=True, completion_only_loss=True,
                         max_length=4096)  # fmt: skip
    assert str(refused.value).startswith("example 1 of the train split: turn 1 (assistant)")
    assert "call of 'get_weather'" in str(refused.value)


def test_qwen3_reasoning_written_inline_is_trained_as_reasoning_content_is():
    qwen = family_tokenizer("qwen3")
    inline, separate = copy.deepcopy(CONVERSATION), copy.deepcopy(CONVERSATION)
    for turn, thought in ((1, "abc backwards"), (3, "xy backwards")):
        inline[turn]["content"] = f"<think>\n{thought}\n</think>\n\n{inline[turn]['content']}"
        separate[turn]["reasoning_content"] = thought
    expected = "cba<|im_end|>\n<think>\nxy backwards\n</think>\n\nyx<|im_end|>\n"  # the template drops earlier thoughts
    assert trained_text(qwen, sft_encode(qwen, {"messages": inline})) == expected
    assert trained_text(qwen, sft_encode(qwen, {"messages": separate})) == expected


def test_gpt_oss_trains_the_last_replys_analysis_and_final_channels():
    oss = family_tokenizer("gpt-oss")
    thinking = copy.deepcopy(CONVERSATION)
    thinking[1]["reasoning_content"], thinking[3]["reasoning_content"] = "first", "second"
    assert trained_text(oss, sft_encode(oss, {"messages": thinking})) == (
        "<|channel|>final<|message|>cba"  # history: its analysis dropped, its <|end|> not the model's <|return|>
        "<|channel|>analysis<|message|>second<|end|><|start|>assistant<|channel|>final<|message|>yx<|return|>"
    )


REVERSE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "reverse",
        "description": "Reverses a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def reverse_tool():
    return tools.Tool("reverse", lambda text: text[::-1], REVERSE_SCHEMA)


WRITES_OTHER_CALLS = {"llama-3.1", "llama-3.2", "mistral-nemo", "gpt-oss", "smollm3"}  # smollm3: drops them


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_tool_rounds_are_checked_on_a_real_round_before_loading(family):
    """A call round is rendered and read back before loading: only Hermes-style calls are read in rollouts."""
    problem = tools.template_problem(family_tokenizer(family), [reverse_tool()])
    if family in ("qwen3", "qwen2.5"):
        assert problem is None
    elif family in WRITES_OTHER_CALLS:
        assert problem.startswith("the tokenizer's chat template writes a tool call as")
    else:
        assert "ignores `tools`" in problem


def test_grpo_tool_rounds_run_on_qwen3s_own_template(monkeypatch):
    """Qwen3 writes the calling turn with an empty think block while it is last and without it once a tool message
    follows: the tool message is appended after the generated turn's end token, never by rendering the turn again."""
    qwen = family_tokenizer("qwen3")
    call = '<think>\n\n</think>\n\n<tool_call>\n{"name": "reverse", "arguments": {"text": "abc"}}\n</tool_call>'
    answer = "<think>\n\n</think>\n\ncba"

    def scripted(model, tokenizer, prompt_ids, keys, settings, *, synced_gpus, images=None):
        turns = [answer if "<tool_response>" in tokenizer.decode(p) else call for p in prompt_ids]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in turns]
        return generation.Generated(ids, [False] * len(turns))

    monkeypatch.setattr(generation, "generate_completions", scripted)
    prompt = qwen.apply_chat_template(
        [{"role": "user", "content": "reverse: abc"}], tools=[REVERSE_SCHEMA], add_generation_prompt=True
    )["input_ids"]
    rolled = tools.generate_with_tools(
        None, qwen, [prompt], [7], GenerationSettings(400, batch_size=1), [reverse_tool()], max_iterations=None,
        timeout=5, synced_gpus=False,
    )  # fmt: skip
    ids, mask = rolled.completion_ids[0], rolled.policy_masks[0]
    assert rolled.tool_calls == [(1, 0)] and rolled.conversations[0][1] == {
        "role": "tool",
        "name": "reverse",
        "content": "cba",
    }
    assert qwen.decode(ids) == (
        call + "<|im_end|>\n<|im_start|>user\n<tool_response>\ncba\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n" + answer + "<|im_end|>"
    )
    assert qwen.decode([t for t, m in zip(ids, mask) if m]) == call + "<|im_end|>" + answer + "<|im_end|>"


def test_sft_on_qwen3s_template_trains_tool_turns_and_exports_the_template_byte_for_byte(tmp_path):
    folder, qwen = tmp_path / "qwen3_tokenizer", family_tokenizer("qwen3")
    qwen.save_pretrained(folder)
    (tmp_path / "data").mkdir(), (tmp_path / "model").mkdir()
    rows = [{"messages": tool_conversation(None)}, {"messages": CONVERSATION}] * 4
    values = base_recipe_values(
        write_tiny_model_config(tmp_path / "model" / "config.json", qwen), write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent, tmp_path / "out",
        max_steps=2, eval_split_size=0.0, tokenizer_name_or_path=str(folder), max_length=256,
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "qwen3", values)
    exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()).get("chat_template")
    if exported is None:
        exported = (tmp_path / "out" / "chat_template.jinja").read_text()
    assert exported == template_text("qwen3")


def trained_pieces(tokenizer, encoded) -> list[str]:
    pieces, current = [], []
    for token, keep in zip(encoded["input_ids"], encoded["loss_mask"]):
        if keep:
            current.append(token)
        elif current:
            pieces, current = pieces + [tokenizer.decode(current)], []
    return pieces + ([tokenizer.decode(current)] if current else [])


def test_qwen3_agent_traces_train_each_reply_never_the_tool_output():
    """Reasoning on a calling turn is dropped once a later user turn follows: the later replies still start where
    their own generation prompt ends, not where the renderings first disagree (inside the calling turn)."""
    qwen = family_tokenizer("qwen3")
    trace = tool_conversation(None)
    trace[1]["reasoning_content"] = "call the tool"
    trace += [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "Welcome."}]
    assert trained_pieces(qwen, sft_encode(qwen, {"messages": trace})) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n',
        "It is sunny.<|im_end|>\n",
        "<think>\n\n</think>\n\nWelcome.<|im_end|>\n",
    ]


@pytest.mark.parametrize("answer", ["a", "final", "message"])
def test_gpt_oss_finds_a_short_earlier_answer_in_its_own_place(answer):
    """An answer that is also a letter or word of the template's own (`<|channel|>final<|message|>`) is trained
    where the reply holds it."""
    oss = family_tokenizer("gpt-oss")
    conversation = copy.deepcopy(CONVERSATION)
    conversation[1].update(content=answer, reasoning_content="pick one")
    assert trained_pieces(oss, sft_encode(oss, {"messages": conversation})) == [
        f"<|channel|>final<|message|>{answer}",
        "<|channel|>final<|message|>yx<|return|>",
    ]


def test_consecutive_replies_under_generation_markers_are_refused_not_dropped():
    smol = family_tokenizer("smollm3")
    example = {"prompt": CONVERSATION[:2], "completion": [{"role": "assistant", "content": "more"}]}
    with pytest.raises(DataError, match=r"\{% generation %\} blocks \(1\) do not match the assistant turns \(2\)"):
        sft_encode(smol, example)


def test_preference_pairs_name_the_templates_own_reason():
    columns = {"prompt": [tool_conversation(None)[:1]], "chosen": [tool_conversation(None)[1:2]],
               "rejected": [[{"role": "assistant", "content": "no idea"}]]}  # fmt: skip
    with pytest.raises(DataError) as refused:
        paired.tokenize_pairs(Dataset.from_dict(columns), family_tokenizer("phi-4"), max_length=4096)
    assert str(refused.value).startswith("pair 0 of the train split: turn 1 (assistant): the tokens the chat template")
    assert "its call of 'get_weather'" in str(refused.value)


def test_a_tools_column_is_shown_to_the_model_and_bad_tools_are_refused_naming_the_example():
    qwen = family_tokenizer("qwen3")
    schema = json.dumps([REVERSE_SCHEMA])
    encoded = sft_encode(qwen, {"messages": CONVERSATION, "tools": schema})
    assert '"name": "reverse"' in qwen.decode(encoded["input_ids"])  # Qwen3's system block lists the tools
    assert trained_text(qwen, encoded) == TRAINED["qwen3"]
    data = Dataset.from_list([{"messages": CONVERSATION, "tools": schema}, {"messages": CONVERSATION, "tools": "[{"}])
    with pytest.raises(DataError, match=r"example 1 of the train split: 'tools' is not valid JSON"):
        tokenize_dataset(data, qwen, assistant_only_loss=True, completion_only_loss=True, max_length=4096)


def broken_call(**function):
    calls = function.pop("calls", None)
    turns = tool_conversation(None)
    turns[1] = {**turns[1], "tool_calls": calls if calls is not None else [{"type": "function", "function": function}]}
    return turns


@pytest.mark.parametrize(
    "turns, reason",
    [
        (broken_call(name="get_weather", arguments='{"city": "Paris"'),
         r"the arguments of its call of 'get_weather' are not valid JSON \(Expecting ',' delimiter.*\): "
         r"'\{\"city\": \"Paris\"'"),
        (broken_call(arguments={"city": "Oslo"}), r"tool call 0 has no function name \('\{\"type\": \"function\""),
        (broken_call(name=" ", arguments={"city": "Oslo"}), "tool call 0 has no function name"),
        (broken_call(name="get_weather", arguments='["Oslo"]'),
         "the arguments of its call of 'get_weather' are a list, not a JSON object of named arguments"),
        (broken_call(name="get_weather", arguments=7), "the arguments of its call of 'get_weather' are an int, not"),
        (broken_call(name="get_weather"), r"its call of 'get_weather' has no arguments \(a call that takes none"),
        (broken_call(calls={"name": "get_weather"}), "'tool_calls' is a mapping, not a list of calls"),
        (broken_call(calls=["get_weather"]), "tool call 0 is a string, not a call"),
        (broken_call(calls=[{"type": "function", "function": "get_weather"}]), "tool call 0's function is a string"),
    ],
    ids=["not-json", "no-name", "blank-name", "json-list", "number", "no-arguments", "calls-mapping", "call-string",
         "function-string"],
)  # fmt: skip
def test_a_tool_call_that_cannot_be_made_is_refused_naming_the_example_and_the_turn(turns, reason):
    """Trained as written, such a call teaches the model to write calls that cannot be made (issue 64)."""
    data = Dataset.from_list([{"messages": CONVERSATION}, {"messages": turns}])  # one type per column, as Arrow wants
    with pytest.raises(DataError, match=rf"^example 1 of the train split: turn 1 \(assistant\): {reason}") as refused:
        tokenize_dataset(data, family_tokenizer("qwen3"), assistant_only_loss=True, completion_only_loss=True,
                         max_length=4096)  # fmt: skip
    assert str(refused.value).endswith("Fix or remove that example.")


def test_a_calls_arguments_as_a_mapping_or_as_json_text_train_the_same_call():
    """TRL and transformers take both; Qwen3's template writes a mapping with tojson and text as it is. The flat
    {"name", "arguments"} form, which the templates read too, is accepted as well."""
    qwen = family_tokenizer("qwen3")
    as_text = broken_call(name="get_weather", arguments='{"city": "Oslo"}')
    flat = broken_call(calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}}])
    for turns in (tool_conversation(None), as_text, flat):
        assert trained_text(qwen, sft_encode(qwen, {"messages": turns})) == TOOL_TURNS_TRAINED["qwen3"]
    pair = {"prompt": as_text[:1], "chosen": as_text[1:2], "rejected": [{"role": "assistant", "content": "no idea"}]}
    assert len(paired.tokenize_pairs(Dataset.from_list([pair]), qwen, max_length=4096)[0]) == 1


REAL_VOCABULARY_FAMILIES = ("qwen2", "qwen2.5", "qwen3", "mistral-nemo", "mistral-small-3")
# A reply that starts with a newline (Qwen's header ends with one: tokenised with the rendering, the two make one
# token) and one that starts with a space.
SPACED = [
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "\ncba"},
    {"role": "user", "content": "reverse: xy"},
    {"role": "assistant", "content": " yx"},
]
SPACED_TRAINED = {
    "qwen2": ["\ncba<|im_end|>\n", " yx<|im_end|>\n"],
    "qwen2.5": ["\ncba<|im_end|>\n", " yx<|im_end|>\n"],
    "qwen3": ["\ncba<|im_end|>\n", "<think>\n\n</think>\n\n yx<|im_end|>\n"],  # the last reply's leading \n: stripped
    "mistral-nemo": ["\ncba</s>", " yx</s>"],
    "mistral-small-3": ["\ncba</s>", " yx</s>"],
}


@pytest.mark.parametrize("family", REAL_VOCABULARY_FAMILIES)
def test_real_vocabularies_train_exactly_each_reply(family):
    """Qwen's byte-level BPE and Mistral's tekken (helpers/real_vocabularies.py) under the families' templates."""
    tokenizer = real_vocabulary_tokenizer(family)
    assert trained_text(tokenizer, sft_encode(tokenizer, {"messages": CONVERSATION})) == TRAINED[family]
    encoded = sft_encode(tokenizer, {"messages": SPACED})
    assert trained_pieces(tokenizer, encoded) == SPACED_TRAINED[family]
    assert tokenizer.decode(encoded["input_ids"]) == tokenizer.apply_chat_template(SPACED, tokenize=False)
    if family in TOOL_TURNS_TRAINED:
        trained = trained_text(tokenizer, sft_encode(tokenizer, {"messages": tool_conversation(None)}))
        assert trained == TOOL_TURNS_TRAINED[family]


@pytest.mark.parametrize("family", REAL_VOCABULARY_FAMILIES)
def test_a_reply_is_tokenised_as_the_model_writes_it_after_its_generation_prompt(family):
    """At inference the prompt ends with the generation prompt, and the model writes the reply's tokens after it: the
    reply's training ids are the reply tokenised apart, after the prompt's text."""
    tokenizer = real_vocabulary_tokenizer(family)
    encoded = sft_encode(tokenizer, {"messages": SPACED})
    ids, mask = encoded["input_ids"], encoded["loss_mask"]
    starts = [i for i, keep in enumerate(mask) if keep and (i == 0 or not mask[i - 1])]
    for start, reply, piece in zip(starts, (1, 3), SPACED_TRAINED[family], strict=True):
        prompt = tokenizer.apply_chat_template(SPACED[:reply], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(ids[:start]) == prompt
        piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        assert ids[start : start + len(piece_ids)] == piece_ids and sum(mask[start:]) >= len(piece_ids)
    first_prompt = tokenizer.apply_chat_template(SPACED[:1], add_generation_prompt=True)["input_ids"]
    assert ids[: len(first_prompt)] == first_prompt
    # Tokenised whole, Qwen's rendering merges the header's newline with the first reply's; tekken's [/INST] cannot
    assert (ids != tokenizer.apply_chat_template(SPACED)["input_ids"]) == family.startswith("qwen")
    # DPO, KTO and reward build each side so: the prompt as at inference, then the answer apart
    side, side_mask = paired.tokenize_side(
        tokenizer, SPACED[:1], SPACED[1:2], max_length=1 << 20, max_prompt_length=None
    )
    answer = trained_text(tokenizer, {"input_ids": side, "loss_mask": side_mask})
    assert side == first_prompt + tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert side_mask == [0] * len(first_prompt) + [1] * (len(side) - len(first_prompt))
    # GRPO's reward-model scorer reads the ids the reward recipe trained on
    scorer = object.__new__(rewards.RewardModel)
    scorer.tokenizer = tokenizer
    assert scorer._ids(SPACED[:1], SPACED[1:2]) == side
