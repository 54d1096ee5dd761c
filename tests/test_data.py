from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.chat import detect_format, tokenize_dataset, tokenize_example
from fsdp_recipes.data.rows import IGNORE_INDEX, build_rows, collate_rows, pack_lengths
from helpers.data import write_tiny_model_config

CONVERSATION = [
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "reverse: xy"},
    {"role": "assistant", "content": "yx"},
]


def loss_text(tokenizer, encoded) -> str:
    return tokenizer.decode([t for t, keep in zip(encoded["input_ids"], encoded["loss_mask"]) if keep])


def test_only_assistant_tokens_carry_loss(tokenizer):
    encoded = tokenize_example(
        {"messages": CONVERSATION},
        tokenizer,
        "conversational",
        assistant_only_loss=True,
        completion_only_loss=True,
        max_length=512,
    )
    # Each assistant turn's text and the token that ends it, nothing from the user turns or the role headers.
    assert loss_text(tokenizer, encoded).replace(" ", "") == f"cba{tokenizer.eos_token}yx{tokenizer.eos_token}"
    everything = tokenize_example(
        {"messages": CONVERSATION},
        tokenizer,
        "conversational",
        assistant_only_loss=False,
        completion_only_loss=True,
        max_length=512,
    )
    assert sum(everything["loss_mask"]) == len(everything["input_ids"])


def test_only_completion_tokens_carry_loss(tokenizer):
    encoded = tokenize_example(
        {"prompt": "reverse: abc", "completion": "cba"},
        tokenizer,
        "prompt_completion",
        assistant_only_loss=True,
        completion_only_loss=True,
        max_length=512,
    )
    assert loss_text(tokenizer, encoded).replace(" ", "") == f"cba{tokenizer.eos_token}"
    conversational = tokenize_example(
        {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]},
        tokenizer,
        "prompt_completion",
        assistant_only_loss=True,
        completion_only_loss=True,
        max_length=512,
    )
    assert loss_text(tokenizer, conversational).replace(" ", "") == f"cba{tokenizer.eos_token}"


def test_targets_are_shifted_within_examples_only(tokenizer):
    data = Dataset.from_list([{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[2:]}])
    tokens, _ = tokenize_dataset(data, tokenizer, assistant_only_loss=False, completion_only_loss=True, max_length=64)
    rows = build_rows(tokens, max_length=64, packing=True)
    assert len(rows) == 1
    row = rows[0]
    first, second = tokens[0]["input_ids"], tokens[1]["input_ids"]
    lengths = sorted([len(first), len(second)], reverse=True)
    boundary = lengths[0]
    assert row["position_ids"] == list(range(lengths[0])) + list(range(lengths[1]))
    assert row["targets"][boundary - 1] == IGNORE_INDEX  # the last token of an example predicts nothing
    assert row["targets"][-1] == IGNORE_INDEX
    assert row["targets"][: boundary - 1] == row["input_ids"][1:boundary]


def test_pack_lengths_respects_capacity_and_keeps_every_example():
    lengths = [5, 9, 3, 7, 1, 10, 2, 2, 6]
    groups = pack_lengths(lengths, capacity=10)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in group) <= 10 for group in groups)
    assert len(groups) == 5  # 45 tokens in rows of 10: best-fit decreasing reaches the minimum


def test_collate_pads_as_a_separate_sequence(tokenizer):
    rows = [
        {"input_ids": [5, 6, 7], "targets": [6, 7, IGNORE_INDEX], "position_ids": [0, 1, 2]},
        {"input_ids": [8], "targets": [IGNORE_INDEX], "position_ids": [0]},
    ]
    batch = collate_rows(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["targets"][1].tolist() == [IGNORE_INDEX] * 3
    assert batch["position_ids"][1].tolist() == [0, 0, 1]
    assert batch["real_tokens"].tolist() == [3, 1]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_row_gives_the_same_logits_as_each_example_alone(tmp_path, tokenizer, attn_implementation):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(write_tiny_model_config(tmp_path / "config.json", tokenizer))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    examples = [torch.randint(4, len(tokenizer), (n,)) for n in (7, 5, 9)]
    packed_ids = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(len(e)) for e in examples])[None]
    with torch.no_grad():
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=e[None], use_cache=False).logits[0] for e in examples])
        leaky = model(input_ids=packed_ids, position_ids=positions).logits[0]  # default use_cache=True
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # The control: with a cache, transformers skips the packed-sequence mask and examples attend to each other.
    assert not torch.allclose(leaky[7:], alone[7:], atol=1e-3)


def test_format_detection_names_the_columns():
    assert detect_format(["messages", "id"]) == "conversational"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    with pytest.raises(DataError, match=r"\['label', 'text'\]"):
        detect_format(["text", "label"])


def test_empty_split_and_nothing_to_learn(tokenizer):
    with pytest.raises(DataError, match="empty"):
        tokenize_dataset(
            Dataset.from_list([]), tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=8
        )
    long_prompt = Dataset.from_list([{"prompt": "x" * 50, "completion": "y"}])
    with pytest.raises(DataError, match="max_length"):
        tokenize_dataset(long_prompt, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=8)


def test_length_grouped_sampler_is_a_seeded_permutation_with_little_padding():
    from fsdp_recipes.data.rows import LengthGroupedSampler

    lengths = [int(x) for x in torch.randint(1, 500, (1000,), generator=torch.Generator().manual_seed(0))]
    sampler = LengthGroupedSampler(lengths, group_size=8, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(1000))
    assert list(sampler) == first  # same seed and epoch, same order
    sampler.set_epoch(1)
    assert list(sampler) != first

    def padding(order):
        groups = [order[i : i + 8] for i in range(0, len(order), 8)]
        slots = sum(8 * max(lengths[i] for i in g) for g in groups)
        return 1 - sum(lengths) / slots

    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(1)).tolist()
    assert padding(first) < 0.05 < 0.3 < padding(shuffled)


def test_plain_prompt_completion_needs_no_chat_template_but_conversations_do(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    plain = Dataset.from_list([{"prompt": "reverse: abc", "completion": "cba"}])
    tokens, _ = tokenize_dataset(plain, bare, assistant_only_loss=True, completion_only_loss=True, max_length=64)
    assert len(tokens) == 1
    with pytest.raises(DataError, match="no chat template"):
        tokenize_dataset(
            Dataset.from_list([{"messages": CONVERSATION}]),
            bare,
            assistant_only_loss=True,
            completion_only_loss=True,
            max_length=64,
        )
