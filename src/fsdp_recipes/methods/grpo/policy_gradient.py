"""The GRPO objective as pure functions of tensors (TRL's `GRPOTrainer` names and semantics, written here):

- `group_advantages`: each completion's reward minus the mean of its group (the completions of one prompt), scaled by
  `scale_rewards` ("group": the group's standard deviation, "batch": the whole batch's, "none": not scaled);
- `token_log_probs`: each completion token's log-probability (logits divided by the sampling temperature, as the
  tokens were drawn) and the distribution's entropy there;
- `per_token_losses`: the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r = exp(log p -
  log p_old), plus `beta` times the k3 estimate of KL(policy || reference): exp(ref - log p) - (ref - log p) - 1;
- `token_weights`: how `loss_type` averages tokens, over the GLOBAL batch (every rank and micro-batch of the
  optimizer step), so that the loss and its gradient do not depend on how the batch is split into ranks:
  grpo: each completion's mean over its tokens, then the mean over completions; dapo and bnpo: the mean over every
  completion token of the batch (TRL's bnpo divides by each process's own token count, which depends on the split:
  here both use the global count, so they coincide); dr_grpo: the sum over tokens / (completions x
  max_completion_length).

A rank's loss is `(per_token_losses * token_weights).sum()`: summed over ranks it is the global loss. With one policy
update per generation batch (`num_iterations` 1) the old log-probabilities are the current ones detached, so r is
exactly 1 and the clipped surrogate equals the unclipped one (its gradient is A times that of log p).
"""

from __future__ import annotations

import math

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: a group whose rewards are all equal gets advantage 0, not a division by 0


def objective_problems(
    beta: float, epsilon: float, epsilon_high: float | None, loss_type: str, scale_rewards: str
) -> list[str]:
    """What is wrong with the objective's settings (TRL's names), for the config's `cross_field_problems`."""
    problems = []
    if not (math.isfinite(beta) and beta >= 0):
        problems.append(f"beta must be >= 0 (0: no reference model), got {beta}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        problems.append(f"epsilon must be > 0 (0.2 is usual), got {epsilon}")
    if epsilon_high is not None and not epsilon_high >= epsilon:
        problems.append(f"epsilon_high must be >= epsilon ({epsilon}), got {epsilon_high}")
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    return problems


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of a batch of rewards laid out group after group (`num_generations` completions of one prompt each).
    Standard deviations are unbiased (torch.std), as TRL's."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r} is not one of {SCALE_REWARDS}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1).repeat_interleave(num_generations) + STD_EPSILON)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + STD_EPSILON)
    return advantages


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """`frac_reward_zero_std`: the share of groups whose completions all got the same reward (nothing to learn)."""
    return float((rewards.view(-1, num_generations).std(dim=1) < 1e-8).float().mean())


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each of `tokens` [rows, width] under `logits` [rows, width, vocab] (the position that
    predicts it) at `temperature`, and the entropy of that distribution; both fp32, shaped like `tokens`."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def kl_k3(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from samples of the policy: never negative, unbiased."""
    delta = reference_log_probs - log_probs
    return torch.exp(delta) - delta - 1


def per_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    reference_log_probs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-token GRPO loss [rows, width] (`advantages` is one value per row) and what is logged of it: `ratio`,
    `low_clipped` (ratio < 1 - epsilon where the advantage is negative), `high_clipped` (ratio > 1 + epsilon_high
    where it is positive), `kl` (zeros when beta is 0)."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_probs - old_log_probs)
    advantage = advantages.unsqueeze(1)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantage
    loss = -torch.min(unclipped, clipped)
    kl = torch.zeros_like(loss)
    if beta:
        if reference_log_probs is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        kl = kl_k3(log_probs, reference_log_probs)
        loss = loss + beta * kl
    return {
        "loss": loss,
        "ratio": ratio.detach(),
        "low_clipped": ((ratio < 1 - epsilon) & (advantage < 0)).float(),
        "high_clipped": ((ratio > 1 + high) & (advantage > 0)).float(),
        "kl": kl.detach(),
    }


def token_weights(
    mask: torch.Tensor, loss_type: str, *, global_completions: float, global_tokens: float, max_completion_length: int
) -> torch.Tensor:
    """The weight of each token of a rank's rows [rows, width] (`mask` 1 where a completion token counts) so that the
    weighted sum over every rank's rows is `loss_type`'s average over the global batch of `global_completions`
    completions holding `global_tokens` counted tokens."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    mask = mask.float()
    if loss_type == "grpo":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / max(global_completions, 1.0)
    if loss_type == "dr_grpo":
        return mask / (max(global_completions, 1.0) * max_completion_length)
    return mask / max(global_tokens, 1.0)  # dapo, bnpo


def loss_figures(terms: dict[str, torch.Tensor], entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's sums of the per-token figures TRL logs as token means (divide by the global token count):
    `kl`, `entropy`, `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`. Kept on the device
    until a logging step reads them."""
    mask = mask.float()
    low, high = terms["low_clipped"].detach() * mask, terms["high_clipped"].detach() * mask
    return {
        "kl": (terms["kl"].detach() * mask).sum(),
        "entropy": (entropy.detach() * mask).sum(),
        "clip_ratio/low_mean": low.sum(),
        "clip_ratio/high_mean": high.sum(),
        "clip_ratio/region_mean": ((low + high) > 0).float().sum(),
    }
