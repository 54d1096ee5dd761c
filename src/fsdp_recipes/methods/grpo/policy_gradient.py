"""The GRPO objective as pure functions of tensors (TRL's `GRPOTrainer` names and semantics, written here):

- `advantages_of`: each completion's reward minus its group's baseline (the completions of one prompt): the group's
  mean (`advantage_estimator` grpo) or the mean of the group's other completions (rloo, TRL RLOO's leave-one-out),
  scaled by `scale_rewards` ("group": the group's standard deviation, "batch": the whole batch's, "none": not scaled);
- `token_log_probs`: each completion token's log-probability (logits divided by the sampling temperature, as the
  tokens were drawn) and the distribution's entropy there;
- `per_token_losses`: the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r = exp(log p -
  log p_old) per token or shared by a completion's tokens (GSPO), with `delta`'s two-sided cap, or `loss_type`'s
  CISPO / SAPO terms instead, plus `beta` times the k3 estimate of KL(policy || reference);
- `entropy_threshold`: the entropy above which a token is in the `top_entropy_quantile` share of a global batch;
- `token_weights`: how `loss_type` averages tokens, over the GLOBAL batch (every rank and micro-batch of the
  optimizer step), so that the loss and its gradient do not depend on how the batch is split into ranks:
  grpo and sapo: each completion's mean over its tokens, then the mean over completions; dapo, bnpo and cispo: the
  mean over every completion token of the batch (TRL's bnpo divides by each process's own token count, which depends
  on the split: here it uses the global count, so it equals dapo); dr_grpo: the sum over tokens / (completions x
  max_completion_length).

A rank's loss is `(per_token_losses * token_weights).sum()`: summed over ranks it is the global loss. With one policy
update per generation batch (`num_iterations` 1) the old log-probabilities are the current ones detached, so r is
exactly 1 and the clipped surrogate equals the unclipped one (its gradient is A times that of log p).
"""

from __future__ import annotations

import math

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: a group whose rewards are all equal gets advantage 0, not a division by 0
ZERO_STD = 1e-8  # a group whose reward standard deviation is below this has nothing to compare


def objective_problems(
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    scale_rewards: str,
    delta: float | None = None,
    loss_type: str = "dapo",
) -> list[str]:
    """What is wrong with the objective's settings (TRL's names), for the config's `cross_field_problems`."""
    problems = []
    if not (math.isfinite(beta) and beta >= 0):
        problems.append(f"beta must be >= 0 (0: no reference model), got {beta}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        problems.append(f"epsilon must be > 0 (0.2 is usual), got {epsilon}")
    if epsilon_high is not None and not epsilon_high >= epsilon:
        problems.append(f"epsilon_high must be >= epsilon ({epsilon}), got {epsilon_high}")
    high = epsilon if epsilon_high is None else epsilon_high
    if delta is not None and not (math.isfinite(delta) and delta > 1 + high):
        problems.append(f"delta must be > 1 + epsilon_high ({1 + high:g}) or null (no two-sided clip), got {delta}")
    if loss_type == "cispo" and not (epsilon_high is not None and epsilon_high >= 1):
        problems.append(
            f"loss_type cispo caps the ratio at epsilon_high itself (CISPO's epsilon_max, 5.0 in TRL's advice): set "
            f"epsilon_high >= 1, got {epsilon_high}"
        )
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    return problems


def share_check(name: str, value: float) -> str | None:
    """A share in (0, 1] (a config field's check)."""
    if math.isfinite(value) and 0 < value <= 1:
        return None
    return f"{name} must be in (0, 1] (1: every token), got {value}"


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of a batch of rewards laid out group after group (`num_generations` completions of one prompt each).
    Standard deviations are unbiased (torch.std), as TRL's."""
    return advantages_of(rewards, num_generations, scale_rewards, "grpo")


def advantages_of(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", estimator: str = "grpo"
) -> torch.Tensor:
    """Each reward against its group's baseline: the group mean (`grpo`), or the mean of the group's other
    completions (`rloo`, leave-one-out: G/(G-1) times the former), then divided by the group's or the batch's
    reward standard deviation (+ 1e-4) as `scale_rewards` says."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r} is not one of {SCALE_REWARDS}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator {estimator!r} is not one of {ADVANTAGE_ESTIMATORS}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    if estimator == "rloo":
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    advantages = (grouped - baseline).flatten()
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1).repeat_interleave(num_generations) + STD_EPSILON)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + STD_EPSILON)
    return advantages


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """`frac_reward_zero_std`: the share of groups whose completions all got the same reward (nothing to learn)."""
    return float((rewards.view(-1, num_generations).std(dim=1) < ZERO_STD).float().mean())


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
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    mask: torch.Tensor | None = None,
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    entropy_mask: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-token policy loss [rows, width] (`advantages` is one value per row) and what is logged of it:
    `ratio`, `low_clipped` (ratio < 1 - epsilon where the advantage is negative), `high_clipped` (ratio > 1 +
    epsilon_high where it is positive), `kl` (zeros when beta is 0).

    The ratio r is exp(log p - log p_old) per token, or with `importance_sampling_level` "sequence" (GSPO) the exp of
    the mean of that over the completion's tokens (`mask`), shared by its tokens. Then, by `loss_type`:
    - the clipped surrogate -min(r' A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r' = min(r, delta) when `delta`
      is set (two-sided clipping), else r;
    - cispo: -sg(min(r, epsilon_high)) A log p: the capped ratio only weighs the token's gradient (the cap is
      epsilon_high itself, TRL's reading of CISPO's epsilon_max, e.g. 5.0: not 1 + epsilon_high);
    - sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau = the positive or negative temperature by the advantage's sign: a
      soft gate whose gradient r sech^2(tau (r - 1) / 2) A fades as r leaves 1, instead of stopping at a bound;
    `entropy_mask` (top_entropy_quantile) and `sampling_weights` (the importance weights of completions another
    engine sampled: `methods.grpo.sampler_mismatch`) multiply that policy term; then `beta` times the k3 estimate of
    KL(policy || reference), exp(ref - log p) - (ref - log p) - 1, is added on every token (as TRL)."""
    high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = log_probs - old_log_probs
    if importance_sampling_level == "sequence":
        if mask is None:
            raise ValueError("sequence-level importance sampling needs the completion mask")
        weights = mask.float()
        log_ratio = (log_ratio * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(log_probs)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level {importance_sampling_level!r} is not one of token, sequence")
    ratio = torch.exp(log_ratio)
    advantage = advantages.unsqueeze(1)
    cap = high if loss_type == "cispo" else 1 + high
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=cap).detach() * advantage * log_probs
    elif loss_type == "sapo":
        positive, negative = sapo_temperatures
        tau = torch.where(advantage > 0, positive, negative)
        loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * advantage
    else:
        unclipped = (ratio if delta is None else torch.clamp(ratio, max=delta)) * advantage
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantage
        loss = -torch.min(unclipped, clipped)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if sampling_weights is not None:
        loss = loss * sampling_weights
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
        "high_clipped": ((ratio > cap) & (advantage > 0)).float(),
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
    if loss_type in ("grpo", "sapo"):
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / max(global_completions, 1.0)
    if loss_type == "dr_grpo":
        return mask / (max(global_completions, 1.0) * max_completion_length)
    return mask / max(global_tokens, 1.0)  # dapo, bnpo, cispo


def entropy_threshold(entropies: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """The entropy at or above which a completion token is among the `top_entropy_quantile` share of highest-entropy
    tokens (`mask` 1 on counted tokens; the whole global batch, for a threshold that does not depend on the split).
    Linear interpolation between ranks, as torch.quantile and TRL's `get_high_entropy_mask`."""
    counted = entropies[mask.bool()].float()
    if counted.numel() == 0:
        return torch.tensor(0.0, device=entropies.device)
    return torch.quantile(counted, 1.0 - top_entropy_quantile)


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
