"""KTO's in-process pieces (methods/preference/unpaired.py, methods/preference/kto.py, recipes/kto.py's checks): TRL's KTO format and paired
data unpaired, the fixed mismatched rows of the KL estimate, the loss and the KL estimate against their formulas, the
per-class figures, and bad input refused before loading. The recipe's launches are in tests/test_preference_runs.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from test_losses import tiny_llama

from fixtures.dpo import dpo_values
from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.methods.preference import kto, unpaired
from fsdp_recipes.train import losses
from helpers.recipes import recipe_error_in_process


def answer_text(tokenizer, ids, targets) -> str:
    return tokenizer.decode([t for t in targets if t != IGNORE_INDEX])


def test_kl_partners_are_a_seeded_derangement():
    partners = unpaired.kl_partners(50, seed=3)
    assert sorted(partners) == list(range(50)) and all(p != i for i, p in enumerate(partners))
    assert partners == unpaired.kl_partners(50, seed=3) and partners != unpaired.kl_partners(50, seed=4)
    assert unpaired.kl_partners(2, seed=0) == [1, 0]


def test_kto_format_gives_each_example_its_row_and_a_mismatched_kl_row(tokenizer):
    data = Dataset.from_dict(
        {"prompt": ["reverse: abc", "reverse: xy", "reverse: hello"], "completion": ["cba", "yx", "hello"]}
        | {"label": [True, True, False]}
    )
    examples, stats = unpaired.tokenize_examples(data, tokenizer, max_length=64, seed=1)
    partners = unpaired.kl_partners(3, seed=1)
    completions = ["cba", "yx", "hello"]
    for i, example in enumerate(examples):
        assert answer_text(tokenizer, example["completion_input_ids"], example["completion_targets"]).startswith(
            completions[i]
        )
        assert answer_text(tokenizer, example["kl_input_ids"], example["kl_targets"]).startswith(
            completions[partners[i]]
        )
        prompt_length = example["completion_targets"].index(next(t for t in example["completion_targets"] if t >= 0))
        assert example["kl_input_ids"][: prompt_length + 1] == example["completion_input_ids"][: prompt_length + 1]
    assert examples["label"] == [True, True, False]
    assert stats["desirable"] == 2 and stats["undesirable"] == 1 and "unpaired" not in stats
    batch = unpaired.collator(tokenizer.pad_token_id)(list(examples))
    assert batch["input_ids"].shape[0] == 6 and batch["label"].tolist() == [True, True, False]
    assert torch.equal(kto.example_rows(batch)["input_ids"], batch["input_ids"][:3])
    assert torch.equal(kto.kl_rows(batch)["targets"], batch["targets"][3:])


def test_paired_data_is_unpaired_and_conversations_work(tokenizer):
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    pairs = Dataset.from_dict(
        {
            "prompt": [[turn("user", "reverse: abc")], [turn("user", "reverse: xy")]],
            "chosen": [[turn("assistant", "cba")], [turn("assistant", "yx")]],
            "rejected": [[turn("assistant", "abc")], [turn("assistant", "xy")]],
        }
    )
    examples, stats = unpaired.tokenize_examples(pairs, tokenizer, max_length=64, seed=0)
    assert examples["label"] == [True, True, False, False]
    assert stats["unpaired"].startswith("2 preference pairs unpaired into 4 examples")
    texts = [answer_text(tokenizer, e["completion_input_ids"], e["completion_targets"]) for e in examples]
    assert [t.split("<")[0].strip() for t in texts] == ["cba", "yx", "abc", "xy"]


@pytest.mark.parametrize(
    "columns, expected",
    [
        ({"prompt": ["a", "b"], "completion": ["x", "y"], "label": ["yes", "no"]}, "label must be true"),
        ({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [1, 0]}, "got 1"),
        ({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [True, True]}, "only desirable (label true)"),
        ({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [False, False]}, "only undesirable"),
        ({"prompt": ["a", "b"], "answer": ["x", "y"]}, "KTO needs 'prompt', 'completion' and 'label'"),
        ({"prompt": ["a"], "completion": ["x"], "label": [True]}, "one example"),
    ],
)
def test_bad_data_is_refused(tokenizer, columns, expected):
    with pytest.raises(DataError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        unpaired.tokenize_examples(Dataset.from_dict(columns), tokenizer, max_length=64, seed=0)


# Four examples: policy and reference log-probabilities of each completion and of each KL row.
POLICY, REFERENCE = [-3.0, -5.0, -4.0, -7.0], [-3.5, -4.0, -4.5, -6.0]
POLICY_KL, REFERENCE_KL = [-9.0, -8.0, -10.0, -6.0], [-9.4, -8.3, -9.9, -6.2]
LABELS = [True, False, True, False]


def test_the_kto_loss_and_kl_estimate_equal_the_formulas():
    beta, good_weight, bad_weight = 0.5, 1.5, 0.8
    kl = float(kto.kl_estimate(sum(p - r for p, r in zip(POLICY_KL, REFERENCE_KL)), 4))
    assert kl == pytest.approx((0.4 + 0.3 - 0.1 + 0.2) / 4)
    assert float(kto.kl_estimate(-1.0, 4)) == 0  # clamped at 0
    objective = kto.KTOLoss("kto", beta, good_weight, bad_weight)
    result = objective(torch.tensor(POLICY), torch.tensor(REFERENCE), torch.tensor(LABELS), kl)

    def s(x):
        return 1 / (1 + math.exp(-x))

    expected = [
        good_weight * (1 - s(beta * (p - r - kl))) if label else bad_weight * (1 - s(beta * (kl - (p - r))))
        for p, r, label in zip(POLICY, REFERENCE, LABELS)
    ]
    assert result.loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert result.rewards.tolist() == pytest.approx([beta * (p - r) for p, r in zip(POLICY, REFERENCE)])
    apo = kto.KTOLoss("apo_zero_unpaired", beta)(torch.tensor(POLICY), torch.tensor(REFERENCE), torch.tensor(LABELS), 9)
    expected = [1 - s(beta * (p - r)) if label else s(beta * (p - r)) for p, r, label in zip(POLICY, REFERENCE, LABELS)]
    assert apo.loss.tolist() == pytest.approx(expected, rel=1e-6)  # no KL term
    first = kto.KTOLoss("kto", beta)(torch.tensor(POLICY), torch.tensor(POLICY), torch.tensor(LABELS), 0.0)
    assert first.loss.tolist() == [0.5] * 4  # policy = reference: 1 - s(0)


def test_per_class_figures_are_class_means_once_divided_by_all_examples():
    result = kto.KTOLoss("kto", 0.5)(torch.tensor(POLICY), torch.tensor(REFERENCE), torch.tensor(LABELS), 0.0)
    labels = torch.tensor(LABELS)
    halves = [  # two ranks' shares of one global batch of 4 (2 good answers)
        kto.figure_sums(
            kto.class_sums(
                kto.KTOResult(result.loss[part], result.rewards[part]), torch.tensor(POLICY)[part], labels[part]
            ),
            examples=4,
            desirable=2,
        )
        for part in (slice(0, 1), slice(1, 4))
    ]
    means = {name: (halves[0][name] + halves[1][name]) / 4 for name in halves[0]}
    assert means["rewards/chosen"] == pytest.approx(0.5 * ((0.5 + 0.5) / 2))
    assert means["rewards/rejected"] == pytest.approx(0.5 * ((-1.0 - 1.0) / 2))
    assert means["rewards/margins"] == pytest.approx(means["rewards/chosen"] - means["rewards/rejected"])
    assert means["logps/chosen"] == pytest.approx(-3.5) and means["logps/rejected"] == pytest.approx(-6.0)
    only_good = kto.class_sums(result, torch.tensor(POLICY), torch.ones(4, dtype=torch.bool))
    one_class = kto.figure_sums(only_good, examples=4, desirable=4)
    assert set(one_class) == {"rewards/chosen", "logps/chosen"}


def test_the_kl_rows_log_probs_are_those_of_prompt_with_the_partners_completion(tokenizer):
    """On a fixed batch: the KL estimate from the recipe's pieces equals log_softmax + gather over the whole logits of
    each prompt followed by its partner's completion, under a policy and a different reference."""
    data = Dataset.from_dict(
        {"prompt": ["reverse: abc", "reverse: xy", "reverse: hello", "reverse: ab"]}
        | {"completion": ["cba", "yx", "hello", "ab"], "label": [True, True, False, False]}
    )
    examples, _ = unpaired.tokenize_examples(data, tokenizer, max_length=64, seed=5)
    batch = unpaired.collator(tokenizer.pad_token_id)(list(examples))
    torch.manual_seed(0)
    policy, reference = tiny_llama(vocab_size=len(tokenizer)), tiny_llama(vocab_size=len(tokenizer))

    def direct(model, ids):  # whole logits, no packing, one sequence at a time
        return model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)

    partners = unpaired.kl_partners(4, seed=5)
    expected_sum = 0.0
    for i, example in enumerate(examples):
        ids, targets = example["kl_input_ids"], example["kl_targets"]
        assert answer_text(tokenizer, ids, targets).startswith(data["completion"][partners[i]])
        with torch.no_grad():
            for model, sign in ((policy, 1.0), (reference, -1.0)):
                logits = direct(model, ids)
                expected_sum += sign * sum(logits[t, target].item() for t, target in enumerate(targets) if target >= 0)
    with torch.no_grad():
        rows = kto.kl_rows(batch)
        policy_kl = losses.sequence_log_probs(losses.TokenLoss(policy).token_losses(policy, rows))
        reference_kl = losses.sequence_log_probs(losses.TokenLoss(reference).token_losses(reference, rows))
    estimate = float(kto.kl_estimate((policy_kl - reference_kl).sum(), 4))
    assert estimate == pytest.approx(max(expected_sum / 4, 0.0), abs=1e-4)
    assert (policy_kl - reference_kl).sum().item() == pytest.approx(expected_sum, abs=1e-4)


@pytest.mark.parametrize(
    "rows, overrides, expected",
    [
        ([{"prompt": "p", "completion": "a", "label": "yes"}], {}, "example 0 of the train split: label must be true"),
        ([{"prompt": "p", "completion": "a", "label": True}], {}, "holds only desirable (label true) examples"),
        ([{"prompt": "p", "completion": "a", "label": False}], {}, "holds only undesirable (label false) examples"),
        ([{"prompt": "p", "completion": "a", "label": True}], {"desirable_weight": 0}, "desirable_weight must be"),
        ([{"prompt": "p", "completion": "a", "label": True}], {"undesirable_weight": -1}, "undesirable_weight must"),
        ([{"prompt": "p", "completion": "a", "label": True}], {"loss_type": "sigmoid"}, "loss_type 'sigmoid' is not"),
        ([{"prompt": "p", "completion": "a", "label": True}], {"beta": 0}, "beta must be a number > 0"),
    ],
)
def test_bad_input_is_one_error_before_loading(tmp_path, pretrained_tiny_model, rows, overrides, expected, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 8))
    values = dpo_values(pretrained_tiny_model, data, tmp_path / "out", eval_split_size=0, **overrides)
    assert expected in recipe_error_in_process("kto", tmp_path, values, capsys)
