"""The in-process pieces of preference tuning: pairs in TRL's formats split into prompt and answers, truncated as TRL
does, collated as chosen rows then rejected rows; summed log-probabilities, the DPO losses and their figures.
Each check here costs well under a second (the recipe's launches are in tests/test_dpo_recipe.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from test_losses import tiny_llama

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.methods.preference import paired
from fsdp_recipes.train import losses


def turn(role: str, text: str) -> dict[str, str]:
    return {"role": role, "content": text}


def split(tokenizer, columns: dict, **options) -> list[tuple[str, str, str, str]]:
    """Each pair as the decoded (chosen prompt, chosen answer, rejected prompt, rejected answer): the prompt is what
    carries no target, the answer what does (targets are shifted, so the trained tokens are the targets)."""
    options.setdefault("max_length", 128)
    pairs, _ = paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, **options)
    decoded = []
    for pair in pairs:
        sides = []
        for side in ("chosen", "rejected"):
            ids, targets = pair[f"{side}_input_ids"], pair[f"{side}_targets"]
            first_trained = next(i for i, t in enumerate(targets) if t != IGNORE_INDEX) + 1
            assert ids[first_trained:] == [t for t in targets if t != IGNORE_INDEX]  # the answer runs to the end
            sides += [tokenizer.decode(ids[:first_trained]), tokenizer.decode(ids[first_trained:])]
        decoded.append(tuple(sides))
    return decoded


# ------------------------------------------------------------------------------------------------ formats
def test_formats_are_recognised_by_their_columns():
    assert paired.detect_format(["prompt", "chosen", "rejected", "score"]) == "explicit"
    assert paired.detect_format(["rejected", "chosen"]) == "implicit"
    with pytest.raises(DataError, match=r"columns \['completion', 'prompt'\].*'prompt', 'chosen' and 'rejected'"):
        paired.detect_format(["prompt", "completion"])
    with pytest.raises(DataError, match=r"columns \['chosen'\]"):
        paired.detect_format(["chosen"])


def test_explicit_strings_keep_the_prompt_out_of_the_loss_and_end_answers_with_eos(tokenizer):
    (pair,) = split(tokenizer, {"prompt": ["reverse: abc => "], "chosen": ["cba"], "rejected": ["bca"]})
    assert pair == ("reverse: abc => ", "cba<|end|>", "reverse: abc => ", "bca<|end|>")


def test_explicit_turns_render_the_prompt_with_the_generation_prompt(tokenizer):
    (pair,) = split(
        tokenizer,
        {
            "prompt": [[turn("system", "be brief"), turn("user", "reverse: abc")]],
            "chosen": [[turn("assistant", "cba")]],
            "rejected": [[turn("assistant", "bca")]],
        },
    )
    prompt = "<|bos|><|system|>be brief<|end|><|user|>reverse: abc<|end|><|assistant|>"
    assert pair == (prompt, "cba<|end|>", prompt, "bca<|end|>")


def test_implicit_strings_share_their_common_start_as_the_prompt(tokenizer):
    (pair,) = split(tokenizer, {"chosen": ["reverse: abc => cba"], "rejected": ["reverse: abc => bca"]})
    assert pair == ("reverse: abc => ", "cba<|end|>", "reverse: abc => ", "bca<|end|>")


def test_implicit_conversations_share_their_leading_turns_as_the_prompt(tokenizer):
    history = [turn("user", "reverse: ab"), turn("assistant", "ba"), turn("user", "reverse: abc")]
    (pair,) = split(
        tokenizer,
        {"chosen": [history + [turn("assistant", "cba")]], "rejected": [history + [turn("assistant", "bca")]]},
    )
    prompt = "<|bos|><|user|>reverse: ab<|end|><|assistant|>ba<|end|><|user|>reverse: abc<|end|><|assistant|>"
    assert pair == (prompt, "cba<|end|>", prompt, "bca<|end|>")


def test_ultrafeedbacks_text_prompt_with_whole_conversations_uses_their_shared_turns(tokenizer):
    """HuggingFaceH4/ultrafeedback_binarized: `prompt` is text, `chosen` and `rejected` repeat it as their first turn
    (found by rehearsing the shipped DPO config on data of that layout); answers alone take the text as a user turn."""
    user = turn("user", "reverse: abc")
    prompt = "<|bos|><|user|>reverse: abc<|end|><|assistant|>"
    whole = split(
        tokenizer,
        {
            "prompt": ["reverse: abc"],
            "chosen": [[user, turn("assistant", "cba")]],
            "rejected": [[user, turn("assistant", "bca")]],
        },
    )
    alone = split(
        tokenizer,
        {"prompt": ["reverse: abc"], "chosen": [[turn("assistant", "cba")]], "rejected": [[turn("assistant", "bca")]]},
    )
    assert whole == alone == [(prompt, "cba<|end|>", prompt, "bca<|end|>")]


def test_pairs_are_numbered_and_counted(tokenizer):
    pairs, stats = paired.tokenize_pairs(
        Dataset.from_dict({"prompt": ["p: ", "pp: "], "chosen": ["a", "bb"], "rejected": ["c", "d"]}),
        tokenizer,
        max_length=64,
    )
    assert pairs["index"] == [0, 1]
    assert stats["pairs"] == 2 and stats["format"] == "explicit"
    assert stats["longest_row"] == len("pp: bb") + 1  # characters are tokens here, and the end-of-text
    assert stats["mean_row_tokens"] == (len("p: a") + len("pp: bb") + 2) / 2


# ------------------------------------------------------------------------------------------------ truncation
def test_a_long_prompt_loses_its_start_and_answers_are_cut_to_max_length(tokenizer):
    (pair,) = split(
        tokenizer,
        {"prompt": ["0123456789 => "], "chosen": ["abcdefgh"], "rejected": ["xy"]},
        max_prompt_length=6,
        max_length=10,
    )
    assert pair == ("89 => ", "abcd", "89 => ", "xy<|end|>")


def test_an_answer_with_nothing_left_after_truncation_names_its_pair_and_the_fix(tokenizer):
    columns = {
        "prompt": ["p: ", "p: ", "a much longer prompt: "],
        "chosen": ["a", "b", "c"],
        "rejected": ["b", "c", "d"],
    }
    with pytest.raises(
        DataError,
        match=r"pair 2 of the eval split: its chosen answer has no token left after "
        r"truncation to max_length=12\. Raise max_length, set \(or lower\) max_prompt",
    ):
        paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, max_length=12, name="eval")


def test_an_empty_answer_names_its_pair(tokenizer):
    columns = {"prompt": ["p: ", "q: "], "chosen": ["a", "b"], "rejected": ["c", ""]}
    with pytest.raises(DataError, match=r"pair 1 of the train split: 'rejected' is empty.*Fix or remove that pair"):
        paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, max_length=64)
    implicit = {"chosen": ["reverse: ab => ba"], "rejected": ["reverse: ab => ba and more"]}  # chosen is a prefix
    with pytest.raises(DataError, match=r"pair 0 of the train split: 'chosen' is empty"):
        paired.tokenize_pairs(Dataset.from_dict(implicit), tokenizer, max_length=64)


def test_a_template_that_does_not_extend_the_prompt_is_refused_with_a_fix_for_dpo(tokenizer):
    """A template that marks the last turn renders the prompt differently once an answer follows it."""
    marking = copy.deepcopy(tokenizer)
    marking.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    columns = {
        "prompt": [[turn("user", "reverse: ab")]],
        "chosen": [[turn("assistant", "ba")]],
        "rejected": [[turn("assistant", "ab")]],
    }
    with pytest.raises(DataError) as error:
        paired.tokenize_pairs(Dataset.from_dict(columns), marking, max_length=64)
    message = str(error.value)
    assert message.startswith("pair 0 of the train split: the chat template")
    assert "chat_template" in message and "assistant_only_loss" not in message  # no SFT option to point at


# ------------------------------------------------------------------------------------------------ collation
def test_a_pair_is_keyed_by_its_content_not_its_position(tokenizer):
    """Precomputed reference values are found by this key: the same pair anywhere has it, an edited one does not."""
    columns = {"prompt": ["p: ", "q: ", "p: "], "chosen": ["ab", "c", "ab"], "rejected": ["x", "yz", "xy"]}
    pairs, _ = paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, max_length=64)
    moved, _ = paired.tokenize_pairs(
        Dataset.from_dict({k: v[::-1] for k, v in columns.items()}), tokenizer, max_length=64
    )
    assert len(set(pairs["key"])) == 3 and sorted(pairs["key"]) == sorted(moved["key"])
    batch = paired.PairCollator(tokenizer.pad_token_id)([pairs[1], pairs[0]])
    assert batch["pair_key"].tolist() == [pairs[1]["key"], pairs[0]["key"]]


def test_a_batch_of_pairs_is_the_chosen_rows_then_the_rejected_rows(tokenizer):
    columns = {"prompt": ["p: ", "long prompt: ", "q: "], "chosen": ["ab", "c", "defg"], "rejected": ["x", "yz", "w"]}
    pairs, _ = paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, max_length=64)
    batch = paired.PairCollator(tokenizer.pad_token_id)([pairs[2], pairs[0], pairs[1]])
    assert batch["pair_index"].tolist() == [2, 0, 1]  # dataset positions of the pairs, in batch order
    width = max(len(pairs[i][f"{side}_input_ids"]) for i in range(3) for side in ("chosen", "rejected"))
    assert batch["input_ids"].shape == batch["targets"].shape == batch["position_ids"].shape == (6, width)
    expected = [(i, "chosen") for i in (2, 0, 1)] + [(i, "rejected") for i in (2, 0, 1)]
    for row, (i, side) in enumerate(expected):
        ids = pairs[i][f"{side}_input_ids"]
        prompt_length = len(columns["prompt"][i])
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert batch["real_tokens"][row] == len(ids)
        # a target at position t is the token t + 1, and only the answer's tokens are targets
        trained = [t for t in batch["targets"][row].tolist() if t != IGNORE_INDEX]
        assert tokenizer.decode(trained) == columns[side][i] + "<|end|>"
        assert (batch["targets"][row, : prompt_length - 1] == IGNORE_INDEX).all()
        assert (batch["targets"][row, len(ids) - 1 :] == IGNORE_INDEX).all()  # the last token and padding
        assert (batch["input_ids"][row, len(ids) :] == tokenizer.pad_token_id).all()
        pad = width - len(ids)
        assert batch["position_ids"][row].tolist() == list(range(len(ids))) + list(range(pad))


# ------------------------------------------------------------------------------------------------ losses
def test_summed_log_probs_equal_log_softmax_and_gather_on_whole_logits(tokenizer):
    columns = {
        "prompt": ["reverse: abc => ", "reverse: hello => "],
        "chosen": ["cba", "olleh"],
        "rejected": ["bca", "hello"],
    }
    pairs, _ = paired.tokenize_pairs(Dataset.from_dict(columns), tokenizer, max_length=64)
    batch = paired.PairCollator(tokenizer.pad_token_id)(list(pairs))
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        summed = losses.sequence_log_probs(losses.TokenLoss(model, chunk_size=7).token_losses(model, batch))
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    targets = batch["targets"]
    trained = targets != IGNORE_INDEX
    gathered = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert summed.shape == (4,)
    torch.testing.assert_close(summed, (gathered * trained).sum(1), rtol=1e-5, atol=1e-5)
    assert (summed < 0).all()
