"""The GRPO objective (fsdp_recipes.methods.grpo.policy_gradient) and the reward functions (fsdp_recipes.methods.grpo.rewards)
against direct computations; no processes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.methods.grpo import policy_gradient as pg
from fsdp_recipes.methods.grpo import rewards, rollouts
from fsdp_recipes.methods.preference import paired

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 3.0, 4.0, 1.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_rewards_minus_the_group_mean_scaled_as_asked(scale):
    advantages = pg.group_advantages(REWARDS, 4, scale)
    for group in range(2):
        values = REWARDS[4 * group : 4 * group + 4].tolist()
        mean = sum(values) / 4
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)  # unbiased, as torch.std and TRL
        batch_std = REWARDS.std().item()
        divisor = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        for i, value in enumerate(values):
            assert advantages[4 * group + i].item() == pytest.approx((value - mean) / divisor, rel=1e-6)


def test_a_group_of_equal_rewards_has_zero_advantage_and_counts_as_zero_std():
    rewards_ = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert pg.group_advantages(rewards_, 2)[:2].tolist() == [0.0, 0.0]
    assert pg.zero_std_fraction(rewards_, 2) == 0.5


def test_one_iteration_has_ratio_exactly_one_and_the_clipped_loss_is_the_unclipped_one():
    torch.manual_seed(0)
    log_probs = torch.randn(3, 5, requires_grad=True)
    advantages = torch.tensor([1.5, -2.0, 0.3])
    terms = pg.per_token_losses(log_probs, log_probs.detach(), advantages, epsilon=0.2)
    assert torch.equal(terms["ratio"], torch.ones(3, 5))
    assert torch.equal(terms["loss"], -advantages.unsqueeze(1).expand(3, 5))
    assert terms["low_clipped"].sum() == terms["high_clipped"].sum() == 0
    terms["loss"].sum().backward()
    torch.testing.assert_close(log_probs.grad, -advantages.unsqueeze(1).expand(3, 5))  # A x d log p


def test_the_ratio_is_clipped_where_it_leaves_the_trust_region_in_the_advantages_direction():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    advantages_pos, advantages_neg = torch.tensor([1.0]), torch.tensor([-1.0])
    pos = pg.per_token_losses(new, old, advantages_pos, epsilon=0.2, epsilon_high=0.28)
    neg = pg.per_token_losses(new, old, advantages_neg, epsilon=0.2, epsilon_high=0.28)
    # A > 0: -min(r, clip(r)) -> -1.28 where r = 1.5; r = 0.5 stays (the min keeps the unclipped, smaller one)
    torch.testing.assert_close(pos["loss"], -torch.tensor([[1.28, 0.5, 1.28, 0.5]]))
    torch.testing.assert_close(neg["loss"], torch.tensor([[1.5, 0.8, 1.5, 0.8]]))
    assert pos["high_clipped"].tolist() == [[1.0, 0.0, 1.0, 0.0]] and pos["low_clipped"].sum() == 0
    assert neg["low_clipped"].tolist() == [[0.0, 1.0, 0.0, 1.0]] and neg["high_clipped"].sum() == 0


def test_kl_is_the_k3_estimator_and_beta_adds_it_to_the_loss():
    log_probs, reference = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    expected = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    torch.testing.assert_close(pg.kl_k3(log_probs, reference), expected)
    terms = pg.per_token_losses(
        log_probs, log_probs, torch.tensor([2.0]), epsilon=0.2, beta=0.1, reference_log_probs=reference
    )
    torch.testing.assert_close(terms["loss"], -2.0 + 0.1 * expected)
    assert (pg.kl_k3(torch.randn(50), torch.randn(50)) >= 0).all()


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_each_loss_type_averages_the_global_batch_whatever_its_split_into_ranks(loss_type):
    torch.manual_seed(1)
    losses = torch.randn(6, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 1, 0]])
    per_row_sum, per_row_count = (losses * mask).sum(1), mask.sum(1)
    expected = {
        "grpo": (per_row_sum / per_row_count.clamp(min=1)).mean(),
        "dapo": per_row_sum.sum() / mask.sum(),
        "bnpo": per_row_sum.sum() / mask.sum(),
        "dr_grpo": per_row_sum.sum() / (6 * 7),
        "cispo": per_row_sum.sum() / mask.sum(),  # averaged as dapo
        "sapo": (per_row_sum / per_row_count.clamp(min=1)).mean(),  # averaged as grpo
    }[loss_type]
    options = dict(global_completions=6, global_tokens=float(mask.sum()), max_completion_length=7)
    for split in ([6], [3, 3], [1, 5], [2, 2, 2]):
        total, start = 0.0, 0
        for rows in split:
            part = slice(start, start + rows)
            total += (losses[part] * pg.token_weights(mask[part], loss_type, **options)).sum()
            start += rows
        torch.testing.assert_close(total, expected)


def test_the_prompt_schedule_and_slots_do_not_depend_on_the_number_of_ranks():
    schedule = rollouts.PromptSchedule(10, 4, seed=3)
    rounds = [schedule.prompts_for_round(r) for r in range(5)]  # 20 prompts: two epochs, each a permutation
    flat = [p for r in rounds for p in r]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10)) and flat[:10] != flat[10:]
    fresh = rollouts.PromptSchedule(10, 4, seed=3)
    assert fresh.prompts_for_round(3) == rounds[3]  # no state: a resume is exact
    # what a checkpoint records names the schedule's own attributes, and is what the round index alone gives
    assert fresh.state_dict() == {"epoch": 1, "batches_into_epoch": 1, "extra_prompts_drawn": 0}
    schedule.prompts_for_round(3)
    assert schedule.state_dict() == fresh.state_dict()
    one = rollouts.rank_slots(rounds[0], 2, rank=0, world_size=1)
    two = rollouts.rank_slots(rounds[0], 2, rank=0, world_size=2) + rollouts.rank_slots(
        rounds[0], 2, rank=1, world_size=2
    )
    assert one == two and len(one) == 8


def test_prompts_drawn_beyond_a_round_shift_the_stream_and_a_restored_schedule_continues_it():
    stream = [p for r in range(6) for p in rollouts.PromptSchedule(10, 4, seed=3).prompts_for_round(r)]
    schedule = rollouts.PromptSchedule(10, 4, seed=3)
    assert schedule.prompts_for_round(0) == stream[0:4]
    assert schedule.more_prompts(4) == stream[4:8] and schedule.more_prompts(4) == stream[8:12]  # round 0's passes
    assert schedule.prompts_for_round(1) == stream[12:16]  # round 1 starts after everything round 0 drew
    restored = rollouts.PromptSchedule(10, 4, seed=3)
    restored.load_state_dict(json.loads(json.dumps(schedule.state_dict())))  # as a checkpoint keeps it
    assert restored.prompts_for_round(2) == schedule.prompts_for_round(2) == stream[16:20]
    assert schedule.state_dict()["extra_prompts_drawn"] == 8 and schedule.epoch == 1


# ---------------------------------------------------------------------------------------------------------- rewards
OPTIONS = rewards.RewardOptions(answer_column="answer", max_completion_length=10)


def built_in(name):
    return rewards.load_reward_function(name, OPTIONS)[1]


def test_built_in_rewards():
    chat = [[{"role": "assistant", "content": " cba "}], [{"role": "assistant", "content": "cbx"}]]
    assert built_in("exact_match")(None, chat, answer=["cba", "cba"]) == [1.0, 0.0]
    assert built_in("partial_match")(None, ["cba", "cbxa", ""], answer=["cba", "cba", "cba"]) == [1.0, 0.5, 0.0]
    assert built_in("numeric_answer")(None, ["so 1,234", "7", "x"], answer=["#### 1234", "none", "#### 3"]) == [
        1.0,
        None,
        0.0,
    ]
    assert built_in("format")(None, ["<think>a</think> <answer>1</answer>", "1"]) == [1.0, 0.0]
    assert built_in("length_penalty")(None, ["a", "b"], completion_ids=[[1, 2], [1] * 10]) == [-0.2, -1.0]


def test_reward_functions_from_a_module_and_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, function = rewards.load_reward_function("my_rewards:shout", OPTIONS)
    assert name == "shout" and function(None, ["a", "b"]) == [1.0, 1.0]
    name, function = rewards.load_reward_function(f"{tmp_path / 'my_rewards.py'}:shout", OPTIONS)
    assert function(None, ["a"]) == [1.0]
    for spec, words in (
        ("no_such_module_xyz:f", "could not be imported"),
        ("my_rewards:missing", "no function 'missing'"),
        (f"{tmp_path}/nope.py:f", "no such file"),
        ("not_a_spec", "not a built-in"),
    ):
        with pytest.raises(ConfigError, match=words):
            rewards.load_reward_function(spec, OPTIONS)


def test_a_reward_model_folder_scores_prompt_and_completion(tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    name, function = rewards.load_reward_function(str(tmp_path / "rm"), OPTIONS)
    prompts = [[{"role": "user", "content": "reverse: abc"}]] * 2
    completions = [[{"role": "assistant", "content": "cba"}], [{"role": "assistant", "content": "abc"}]]
    scores = function(prompts, completions)
    text_scores = function(["reverse: abc => "] * 2, ["cba", "abc"])

    def as_trained(prompt, answer):  # the row recipes/reward.py scores: text answers end with the eos token
        ids, _ = paired.tokenize_side(tokenizer, prompt, answer, max_length=1 << 20, max_prompt_length=None)
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    assert name == "rm" and len(scores) == 2 and scores[0] != scores[1]
    assert scores[0] == pytest.approx(as_trained(prompts[0], completions[0]), rel=1e-5)
    assert text_scores[1] == pytest.approx(as_trained("reverse: abc => ", "abc"), rel=1e-5)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two")
    tokenizer.save_pretrained(tmp_path / "two")
    with pytest.raises(ConfigError, match="one label"):
        rewards.load_reward_function(str(tmp_path / "two"), OPTIONS)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lm")  # a causal LM: 2 labels by default
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(ConfigError, match="is not a sequence classifier .*LlamaForCausalLM"):
        rewards.load_reward_function(str(tmp_path / "lm"), OPTIONS)


def scored(function, **overrides):
    values = dict(
        prompts=["p0", "p1", "p2"], completions=["a", "b", "c"], completion_ids=[[1], [2], [3]],
        columns={"answer": ["a", "x", "c"]}, prompt_indices=[10, 11, 12],
    )  # fmt: skip
    values.update(overrides)
    return rewards.score([(getattr(function, "__name__", "f"), function)], [2.0], **values)


def test_scores_are_weighted_and_none_is_no_reward():
    def sometimes(prompts, completions, **kw):
        return [1.0, None, 0.5]

    total, per_function = scored(sometimes)
    assert total.tolist() == [2.0, 0.0, 1.0] and math.isnan(per_function[0, 1])


@pytest.mark.parametrize(
    ("returned", "words"),
    [
        ("raise", "reward function bad raised ValueError: no 'b' .* prompt 11"),
        ([1.0, 2.0], "reward function bad returned 2 values for 3 completions"),
        ([1.0, math.nan, 0.0], "reward function bad returned nan .* prompt 11"),
        ([1.0, -math.inf, 0.0], "reward function bad returned -inf .* prompt 11 .*: rewards must be finite numbers"),
        ([1.0, "x", 0.0], "reward function bad returned 'x' .* prompt 11"),
    ],
)
def test_a_failing_reward_names_the_function_and_the_prompt(returned, words):
    def bad(prompts, completions, **kw):
        if returned == "raise" and "b" in completions:
            raise ValueError("no 'b'")
        return returned if returned != "raise" else [0.0] * len(completions)

    with pytest.raises(DataError, match=words):
        scored(bad)
