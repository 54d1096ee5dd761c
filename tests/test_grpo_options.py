"""GRPO's further options against their formulas written out on fixed numbers (fsdp_recipes.methods.grpo): GSPO's
sequence-level ratio, CISPO, SAPO, two-sided clipping, RLOO advantages, the entropy threshold, dynamic sampling's
choice of groups, and padding-free passes against padded ones on a tiny model; no processes."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_recipes.methods.grpo import groups, padding_free, rollouts
from fsdp_recipes.methods.grpo import policy_gradient as pg


def test_a_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio_shared_by_the_tokens():
    log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.7, -0.1]])
    old = torch.tensor([[-1.2, -2.4, -3.0], [-0.5, -0.2, -0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -2.0])
    terms = pg.per_token_losses(
        log_probs, old, advantages, epsilon=0.2, importance_sampling_level="sequence", mask=mask
    )
    first, second = math.exp((0.2 + 0.4) / 2), math.exp((0.0 - 0.5 + 0.3) / 3)  # padding is left out
    torch.testing.assert_close(terms["ratio"], torch.tensor([[first] * 3, [second] * 3]))
    # A = 1, r = 1.35: clipped at 1.2; A = -2, r = 0.94 inside the region: -r A
    torch.testing.assert_close(terms["loss"], torch.tensor([[-1.2] * 3, [2 * second] * 3]))


def test_with_one_token_per_completion_the_sequence_level_ratio_is_the_token_level_one():
    torch.manual_seed(0)
    log_probs, old = torch.randn(5, 1, requires_grad=True), torch.randn(5, 1)
    advantages = torch.randn(5)
    by_token = pg.per_token_losses(log_probs, old, advantages, epsilon=0.2, epsilon_high=0.3)
    by_sequence = pg.per_token_losses(
        log_probs, old, advantages, epsilon=0.2, epsilon_high=0.3, importance_sampling_level="sequence",
        mask=torch.ones(5, 1),
    )  # fmt: skip
    torch.testing.assert_close(by_sequence["loss"], by_token["loss"])
    (gradient,) = torch.autograd.grad(by_sequence["loss"].sum(), log_probs)
    (expected,) = torch.autograd.grad(by_token["loss"].sum(), log_probs)
    torch.testing.assert_close(gradient, expected)


def test_cispo_weighs_every_tokens_log_prob_by_its_detached_ratio_capped_above():
    log_probs = torch.tensor([[math.log(0.9), math.log(0.2)]], requires_grad=True)
    old = torch.log(torch.tensor([[0.5, 0.4]]))  # ratios 1.8 and 0.5
    terms = pg.per_token_losses(log_probs, old, torch.tensor([2.0]), epsilon=0.2, epsilon_high=1.5, loss_type="cispo")
    weights = torch.tensor([[1.5, 0.5]])  # 1.8 capped at epsilon_high itself (TRL's epsilon_max); nothing below
    torch.testing.assert_close(terms["loss"], -weights * 2.0 * log_probs.detach())
    (gradient,) = torch.autograd.grad(terms["loss"].sum(), log_probs)
    torch.testing.assert_close(gradient, -weights * 2.0)  # the capped token still gets a gradient (clip stops it)
    clipped = pg.per_token_losses(log_probs, old, torch.tensor([2.0]), epsilon=0.2, epsilon_high=0.28)
    (cut,) = torch.autograd.grad(clipped["loss"].sum(), log_probs)
    assert cut[0, 0] == 0 and cut[0, 1] != 0


def test_sapo_is_a_soft_sigmoid_gate_with_a_temperature_per_advantage_sign():
    log_probs = torch.log(torch.tensor([[1.0, 1.5], [1.0, 0.6]])).requires_grad_()
    old = torch.zeros(2, 2)
    advantages = torch.tensor([1.0, -3.0])
    terms = pg.per_token_losses(log_probs, old, advantages, epsilon=0.2, loss_type="sapo", sapo_temperatures=(2.0, 0.5))

    def gate(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    expected = torch.tensor([[-gate(1.0, 2.0), -gate(1.5, 2.0)], [3 * gate(1.0, 0.5), 3 * gate(0.6, 0.5)]])
    torch.testing.assert_close(terms["loss"], expected)
    (gradient,) = torch.autograd.grad(terms["loss"].sum(), log_probs)
    assert gradient[0, 0] == pytest.approx(-1.0) and gradient[1, 0] == pytest.approx(3.0)  # at r = 1: -A
    sigma = 1 / (1 + math.exp(-2.0 * 0.5))  # r = 1.5, tau 2: the gradient fades, it does not stop
    assert gradient[0, 1] == pytest.approx(-4 * sigma * (1 - sigma) * 1.5)


def test_delta_caps_the_unclipped_ratio_of_tokens_with_a_negative_advantage():
    log_probs, old = torch.log(torch.tensor([[3.0, 1.1]])), torch.zeros(1, 2)
    plain = pg.per_token_losses(log_probs, old, torch.tensor([-1.0]), epsilon=0.2)
    two_sided = pg.per_token_losses(log_probs, old, torch.tensor([-1.0]), epsilon=0.2, delta=2.0)
    torch.testing.assert_close(plain["loss"], torch.tensor([[3.0, 1.1]]))  # -min(-r, -clip(r)) = r here
    torch.testing.assert_close(two_sided["loss"], torch.tensor([[2.0, 1.1]]))


def test_the_entropy_mask_leaves_out_the_policy_term_of_a_token_not_its_kl():
    log_probs, old = torch.log(torch.tensor([[0.5, 0.4]])), torch.log(torch.tensor([[0.4, 0.4]]))
    reference = torch.log(torch.tensor([[0.25, 0.8]]))
    options = dict(epsilon=0.2, beta=0.1, reference_log_probs=reference)
    whole = pg.per_token_losses(log_probs, old, torch.tensor([1.0]), **options)
    masked = pg.per_token_losses(log_probs, old, torch.tensor([1.0]), **options, entropy_mask=torch.tensor([[0, 1]]))
    assert masked["loss"][0, 0] == pytest.approx(0.1 * float(whole["kl"][0, 0]))  # KL alone: as TRL, on every token
    assert masked["loss"][0, 1] == whole["loss"][0, 1]


def test_rloo_advantages_are_rewards_minus_the_mean_of_the_other_completions():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0, 0.0, 0.0, 1.0])
    expected = [1 - 1 / 3, 0 - 2 / 3, 0.5 - 0.5, 0.5 - 0.5, 3 - 1 / 3, 0 - 4 / 3, 0 - 4 / 3, 1 - 1.0]
    torch.testing.assert_close(pg.advantages_of(rewards, 4, "none", "rloo"), torch.tensor(expected))
    grpo = pg.advantages_of(rewards, 4, "none", "grpo")
    torch.testing.assert_close(pg.advantages_of(rewards, 4, "none", "rloo"), grpo * 4 / 3)  # G / (G - 1) x GRPO's
    std = rewards.view(2, 4).std(dim=1).repeat_interleave(4) + pg.STD_EPSILON
    torch.testing.assert_close(pg.advantages_of(rewards, 4, "group", "rloo"), torch.tensor(expected) / std)


def test_the_entropy_threshold_keeps_the_top_share_of_counted_tokens():
    entropies = torch.tensor([[0.1, 0.9, 5.0], [0.5, 0.3, 0.7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # 5.0 is padding: not counted
    threshold = pg.entropy_threshold(entropies, mask, 0.4)  # the 60% quantile of 0.1, 0.3, 0.5, 0.7, 0.9
    assert float(threshold) == pytest.approx(0.58)
    assert ((entropies >= threshold) & mask.bool()).sum() == 2  # 0.9 and 0.7
    assert float(pg.entropy_threshold(entropies, mask, 1.0)) == pytest.approx(0.1)  # 1: every token


def scored(prompts: list[int], rewards: list[float]) -> groups.ScoredSlots:
    count = len(rewards)
    return groups.ScoredSlots(
        [p for p in prompts for _ in range(count // len(prompts))],
        [[i] for i in range(count)],
        [False] * count,
        torch.tensor(rewards),
        torch.tensor(rewards).unsqueeze(1),
    )


def test_dynamic_sampling_keeps_groups_with_a_reward_spread_and_fills_from_the_others_at_its_bound():
    pool = groups.GroupPool(3, 2, dynamic_sampling=True)
    pool.add(scored([10, 11, 12], [1.0, 1.0, 0.0, 1.0, 0.5, 0.5]))  # prompt 11 has a spread
    assert not pool.full()
    pool.add(scored([13, 14, 15], [0.0, 0.0, 1.0, 0.0, 2.0, 2.0]))  # 14 has
    assert not pool.full()  # two of three: the recipe stops here at max_generation_rounds 2
    batch, kept = pool.batch()
    assert kept == 2 and batch.prompt_indices == [11, 11, 14, 14, 10, 10]  # the spread ones, then the first flat one
    assert not bool(groups.groups_with_spread(batch.rewards, 2)[2])
    pool.add(scored([16, 17, 18], [0.0, 1.0, 0.0, 1.0, 3.0, 3.0]))
    assert pool.full()
    batch, kept = pool.batch()
    assert kept == 3 and batch.prompt_indices == [11, 11, 14, 14, 16, 16]  # no zero-variance group is kept
    assert len(pool.generated) == 18


def test_without_dynamic_sampling_the_first_pass_is_the_batch():
    pool = groups.GroupPool(2, 2, dynamic_sampling=False)
    pool.add(scored([4, 5], [1.0, 1.0, 0.0, 1.0]))
    assert pool.full()
    batch, kept = pool.batch()
    assert batch.prompt_indices == [4, 4, 5, 5] and kept == 1


def test_padding_free_passes_give_the_padded_log_probs_and_entropies_from_fewer_rows():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 50, (int(n),), generator=draw).tolist() for n in (2, 8, 3, 5, 7, 2)]
    completions = [torch.randint(3, 50, (int(n),), generator=draw).tolist() for n in (1, 6, 2, 4, 1, 3)]
    batch = rollouts.rollout_batch(prompts, completions, pad_token_id=0, prompt_width=8, completion_width=6)
    packed = padding_free.packed_rows(batch, row_width=14, pad_token_id=0)
    assert packed["packed_input_ids"].shape[0] < batch["input_ids"].shape[0]
    assert packed["packed_input_ids"].numel() < batch["input_ids"].numel()
    assert len(packed["packed_targets"]) == sum(map(len, completions))
    batch["real_tokens"] = batch["attention_mask"].sum(dim=1)
    assert rollouts.rows_run({**batch, **packed})["input_ids"] is packed["packed_input_ids"]  # what metrics count
    padded_values = rollouts.completion_log_probs(model, batch, 0.7)
    packed_values = rollouts.completion_log_probs(model, {**batch, **packed}, 0.7)
    mask = batch["completion_mask"].bool()
    for padded, from_packed in zip(padded_values, packed_values):
        torch.testing.assert_close(from_packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
        assert (from_packed[~mask] == 0).all()
