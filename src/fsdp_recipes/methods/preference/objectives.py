"""Preference losses, from each answer's summed completion log-probability (`losses.sequence_log_probs`): TRL's DPO
catalogue, the reference-free SimPO and ORPO, weighted combinations of them (`loss_type: [sigmoid, sft]` with
`loss_weights`: RPO), and KTO's for answers marked good or bad one by one.

Every function returns per-example values; recipes sum them over a micro-batch and scale by the global number of
examples, so the loss is their mean over the global batch whatever its split into ranks and micro-batches. The only
exceptions are `aot` and `aot_unpaired`, which sort the pairs of a micro-batch (TRL: of a device batch) against each
other: their values depend on `per_device_train_batch_size`, not on the number of ranks.

Names, formulas and parameters follow TRL 1.x (`DPOTrainer`, `CPOTrainer` for SimPO, `ORPOTrainer`, `KTOTrainer`);
where this layer averages differently it says so on the loss (`LOSS_HELP`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

# h = (policy - reference) of the chosen answer - (policy - reference) of the rejected one; "averaged": over the
# answer's completion tokens; b = beta, e = label_smoothing.
LOSS_HELP = {
    "sigmoid": "DPO: -log s(b h); with label_smoothing e, mixes in e x the flipped pair's loss (cDPO)",
    "hinge": "SLiC: max(0, 1 - b h)",
    "ipo": "IPO: (h averaged per answer - 1/(2b))^2",
    "exo_pair": "EXO: KL of softmax(b h) from (1 - e, e); needs label_smoothing > 0 (1e-3 suggested)",
    "nca_pair": "NCA: -log s(b c) - (log s(-b c) + log s(-b r)) / 2, c and r each answer's policy - reference",
    "robust": "robust DPO: ((1 - e)(-log s(b h)) - e(-log s(-b h))) / (1 - 2e), e the chance a label is flipped",
    "bco_pair": "BCO on pairs: -log s(b c) - log s(-b r)",
    "sppo_hard": "SPPO, hard labels: (c - 1/(2b))^2 + (r + 1/(2b))^2",
    "aot": "AOT: sigmoid on sorted policy margins - sorted reference margins, sorted within a micro-batch",
    "aot_unpaired": "AOT unpaired: sigmoid on sorted c - sorted r, sorted within a micro-batch",
    "apo_zero": "APO-zero: 1 - s(b c) + s(b r) (the chosen answers beat the model's own)",
    "apo_down": "APO-down: s(b c) + 1 - s(b h) (the chosen answers are worse than the model's own)",
    "discopop": "DiscoPOP: log-ratio-modulated mix of -log s(b h) and exp(-b h), discopop_tau",
    "sigmoid_norm": "DPO on log-ratios averaged per answer: -log s(b h averaged)",
    "sft": "NLL of the chosen answer, per token (RPO's term; TRL averages over the batch's tokens instead)",
    "simpo": "SimPO (no reference): -log s(b (averaged policy log-prob margin) - simpo_gamma), + cpo_alpha x sft",
    "orpo": "ORPO (no reference): sft - b log s(log odds ratio of the averaged log-probs); b is ORPO's lambda",
}
NEEDS_REFERENCE = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)
REFERENCE_FREE = ("sft", "simpo", "orpo")
LOSS_TYPES = NEEDS_REFERENCE + REFERENCE_FREE
USES_LABEL_SMOOTHING = ("sigmoid", "exo_pair", "robust", "aot", "aot_unpaired", "simpo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def as_list(loss_type: str | list[str]) -> list[str]:
    """`loss_type` as TRL takes it: one name or a list of names."""
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


def needs_reference(loss_type: str | list[str]) -> list[str]:
    """The losses of `loss_type` that compare with a reference model (none: no reference is loaded)."""
    return [name for name in as_list(loss_type) if name in NEEDS_REFERENCE]


def configuration_problems(
    loss_type: str | list[str],
    loss_weights: list[float] | None,
    *,
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
    simpo_gamma: float,
    cpo_alpha: float,
) -> list[str]:
    """What is wrong with a preference-loss configuration, one sentence each (empty: nothing)."""
    names, problems = as_list(loss_type), []
    if not (math.isfinite(beta) and beta > 0):
        problems.append(f"beta must be a number > 0, got {beta} (0.1 is usual; it scales the implicit reward)")
    unknown = [name for name in names if name not in LOSS_TYPES]
    if unknown or not names:
        shown = ", ".join(map(repr, unknown)) or "an empty list"
        problems.append(f"loss_type {shown} is not one of {', '.join(LOSS_TYPES)}")
    if len(set(names)) != len(names):
        problems.append(f"loss_type {names} names a loss twice: give it one entry and a weight in loss_weights")
    if loss_weights is not None:
        if len(loss_weights) != len(names):
            problems.append(
                f"loss_weights has {len(loss_weights)} weights for the {len(names)} losses of loss_type {names}: give "
                "one weight per loss, in the same order (or leave loss_weights out: each weighs 1)"
            )
        if any(not (math.isfinite(weight) and weight >= 0) for weight in loss_weights):
            problems.append(f"loss_weights must be numbers >= 0, got {loss_weights}")
        elif loss_weights and not any(loss_weights):
            problems.append("loss_weights are all 0: nothing would be trained")
    if not 0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    elif label_smoothing and not set(names) & set(USES_LABEL_SMOOTHING):
        problems.append(f"label_smoothing applies to loss_type {', '.join(USES_LABEL_SMOOTHING)} only")
    if "exo_pair" in names and not label_smoothing > 0:
        problems.append("loss_type exo_pair needs label_smoothing > 0 (its target is (1 - e, e); 1e-3 is suggested)")
    if "discopop" in names and not (math.isfinite(discopop_tau) and discopop_tau > 0):
        problems.append(f"discopop_tau must be a number > 0, got {discopop_tau} (0.05 is the paper's)")
    if not math.isfinite(simpo_gamma):
        problems.append(f"simpo_gamma must be a number, got {simpo_gamma}")
    if not (math.isfinite(cpo_alpha) and cpo_alpha >= 0):
        problems.append(f"cpo_alpha must be a number >= 0, got {cpo_alpha}")
    elif cpo_alpha and "simpo" not in names:
        problems.append("cpo_alpha weighs the NLL term of loss_type simpo only; for other losses add sft to loss_type")
    return problems


@dataclasses.dataclass(frozen=True)
class PairLosses:
    """Per-pair values: the (weighted) loss, each component before weighting, and the implicit rewards (detached)."""

    loss: torch.Tensor
    components: dict[str, torch.Tensor]
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """A preference loss, one type or a weighted sum of several, as a function of per-pair summed log-probabilities.

    Rewards: beta x (policy - reference) when a loss needs the reference (TRL's DPO); beta x the policy's
    log-probability averaged per answer token when none does (TRL's CPO/SimPO and ORPO)."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    @classmethod
    def from_config(cls, config) -> PreferenceLoss:
        """From a config with TRL's field names (loss_type, loss_weights, beta, label_smoothing, ...)."""
        names = tuple(as_list(config.loss_type))
        weights = tuple(config.loss_weights) if config.loss_weights is not None else (1.0,) * len(names)
        return cls(
            names,
            weights,
            config.beta,
            config.label_smoothing,
            config.discopop_tau,
            config.simpo_gamma,
            config.cpo_alpha,
        )

    @property
    def needs_reference(self) -> bool:
        return any(name in NEEDS_REFERENCE for name in self.loss_types)

    @property
    def description(self) -> str:
        terms = [
            name if weight == 1 or len(self.loss_types) == 1 else f"{weight:g} x {name}"
            for name, weight in zip(self.loss_types, self.loss_weights)
        ]
        return f"{' + '.join(terms)}, beta {self.beta:g}" + ("" if self.needs_reference else " (no reference model)")

    def __call__(
        self,
        policy_chosen: torch.Tensor,
        policy_rejected: torch.Tensor,
        reference_chosen: torch.Tensor | None,
        reference_rejected: torch.Tensor | None,
        chosen_lengths: torch.Tensor,
        rejected_lengths: torch.Tensor,
    ) -> PairLosses:
        if self.needs_reference and (reference_chosen is None or reference_rejected is None):
            raise ValueError(f"loss_type {list(self.loss_types)} needs the reference's log-probabilities")
        chosen_lengths = chosen_lengths.clamp(min=1).to(policy_chosen.dtype)
        rejected_lengths = rejected_lengths.clamp(min=1).to(policy_rejected.dtype)
        values = dict(
            policy_chosen=policy_chosen,
            policy_rejected=policy_rejected,
            reference_chosen=reference_chosen,
            reference_rejected=reference_rejected,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
        )
        components = {name: self._component(name, **values) for name in self.loss_types}
        loss = sum(weight * components[name] for name, weight in zip(self.loss_types, self.loss_weights))
        if self.needs_reference:
            chosen_rewards = self.beta * (policy_chosen - reference_chosen)
            rejected_rewards = self.beta * (policy_rejected - reference_rejected)
        else:
            chosen_rewards = self.beta * policy_chosen / chosen_lengths
            rejected_rewards = self.beta * policy_rejected / rejected_lengths
        return PairLosses(loss, components, chosen_rewards.detach(), rejected_rewards.detach())

    def _component(
        self,
        name,
        *,
        policy_chosen,
        policy_rejected,
        reference_chosen,
        reference_rejected,
        chosen_lengths,
        rejected_lengths,
    ) -> torch.Tensor:
        beta, smoothing = self.beta, self.label_smoothing
        nll = -policy_chosen / chosen_lengths
        if name == "sft":
            return nll
        if name == "simpo":
            margin = policy_chosen / chosen_lengths - policy_rejected / rejected_lengths - self.simpo_gamma / beta
            return _smoothed_sigmoid(beta * margin, smoothing) + self.cpo_alpha * nll
        if name == "orpo":
            chosen_mean, rejected_mean = policy_chosen / chosen_lengths, policy_rejected / rejected_lengths
            log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
            return nll - beta * F.logsigmoid(log_odds)
        chosen, rejected = policy_chosen - reference_chosen, policy_rejected - reference_rejected
        h = chosen - rejected
        if name == "sigmoid":
            return _smoothed_sigmoid(beta * h, smoothing)
        if name == "hinge":
            return torch.relu(1 - beta * h)
        if name == "ipo":
            return (chosen / chosen_lengths - rejected / rejected_lengths - 1 / (2 * beta)) ** 2
        if name == "exo_pair":
            z = beta * h
            return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-smoothing)) + torch.sigmoid(-z) * (
                F.logsigmoid(-z) - math.log(smoothing)
            )
        if name == "nca_pair":
            return (
                -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
            )
        if name == "robust":
            clean, flipped = -F.logsigmoid(beta * h), -F.logsigmoid(-beta * h)
            return ((1 - smoothing) * clean - smoothing * flipped) / (1 - 2 * smoothing)
        if name == "bco_pair":
            return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
        if name == "sppo_hard":
            return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
        if name == "aot":
            policy_sorted = torch.sort(policy_chosen - policy_rejected).values
            reference_sorted = torch.sort(reference_chosen - reference_rejected).values
            return _smoothed_sigmoid(beta * (policy_sorted - reference_sorted), smoothing)
        if name == "aot_unpaired":
            return _smoothed_sigmoid(beta * (torch.sort(chosen).values - torch.sort(rejected).values), smoothing)
        if name == "apo_zero":
            return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
        if name == "apo_down":
            return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * h)
        if name == "discopop":
            z = beta * h
            mix = torch.sigmoid(z / self.discopop_tau)
            return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)
        if name == "sigmoid_norm":
            return -F.logsigmoid(beta * (chosen / chosen_lengths - rejected / rejected_lengths))
        raise ValueError(f"loss_type {name!r} is not one of {', '.join(LOSS_TYPES)}")


def _smoothed_sigmoid(z: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-log s(z), with probability `smoothing` that the preference is the other way round."""
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_figures(result: PairLosses, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict:
    """Per-pair values of the figures TRL logs (their means over the pairs are logged): the rewards of each answer,
    whether the chosen one wins (a tie is no win), by how much, the policy's log-probabilities, and with several loss
    types each one's value (`loss/<type>`, before weighting). All detached."""
    chosen, rejected = result.chosen_rewards, result.rejected_rewards
    figures = {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).float(),
        "rewards/margins": chosen - rejected,
        "logps/chosen": policy_chosen.detach(),
        "logps/rejected": policy_rejected.detach(),
    }
    if len(result.components) > 1:
        figures.update({f"loss/{name}": value.detach() for name, value in result.components.items()})
    return figures
