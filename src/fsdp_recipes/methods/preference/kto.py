"""KTO (Kahneman-Tversky optimisation) on answers marked good or bad one by one (`methods/preference/unpaired.py`), as TRL's
KTOTrainer computes it, from summed completion log-probabilities:

- r = policy - reference log-probability of an example's completion (its implicit reward is beta x r);
- z = max(0, mean over the global batch of the same on the mismatched KL rows), detached: TRL's estimate of
  KL(policy || reference), there the mean of each device batch averaged over processes; here a sum and a count
  all-reduced over the whole optimizer step, so it is the same whatever the split into ranks and micro-batches;
- loss_type "kto": desirable_weight x (1 - s(beta (r - z))) for a good answer, undesirable_weight x
  (1 - s(beta (z - r))) for a bad one; "apo_zero_unpaired": 1 - s(beta r) and s(beta r), with no KL term;
- averaged over the examples of the global batch (TRL: of each micro-batch).

Figures under TRL's names: `rewards/chosen` and `logps/chosen` are means over the good answers,
`rewards/rejected` and `logps/rejected` over the bad ones, `rewards/margins` their difference, `kl` the estimate.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fsdp_recipes.distributed.collectives import gather_for_metrics
from fsdp_recipes.train.evaluation import Evaluation
from fsdp_recipes.train.losses import TokenLoss, sequence_log_probs

LOSS_TYPES = ("kto", "apo_zero_unpaired")


def configuration_problems(loss_type: str, beta: float, desirable_weight: float, undesirable_weight: float) -> list:
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if not (math.isfinite(beta) and beta > 0):
        problems.append(f"beta must be a number > 0, got {beta} (0.1 is usual; it scales the implicit reward)")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not (math.isfinite(weight) and weight > 0):
            problems.append(
                f"{name} must be a number > 0, got {weight} (1.0 is usual; to train on one kind of answer only, "
                "leave the other kind out of the data instead)"
            )
    return problems


def example_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first half of a KTO batch's rows: each example's prompt with its own completion."""
    count = batch["pair_index"].numel()
    return {
        name: batch[name][:count] for name in ("input_ids", "position_ids", "targets", "real_tokens") if name in batch
    }


def kl_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The second half: each example's prompt with its partner's completion (the KL estimate's rows)."""
    count = batch["pair_index"].numel()
    return {
        name: batch[name][count:] for name in ("input_ids", "position_ids", "targets", "real_tokens") if name in batch
    }


def kl_estimate(kl_sum: torch.Tensor | float, count: torch.Tensor | float) -> torch.Tensor:
    """TRL's KL estimate from the global sum of the KL rows' log-ratios and their number: their mean, at least 0 (a
    float64 tensor where `kl_sum` is: the step uses it on the device without reading it)."""
    kl_sum = torch.as_tensor(kl_sum, dtype=torch.float64)
    count = torch.as_tensor(count, dtype=torch.float64, device=kl_sum.device)
    return (kl_sum / count.clamp(min=1.0)).clamp(min=0.0)


@dataclasses.dataclass(frozen=True)
class KTOResult:
    loss: torch.Tensor  # per example, weighted
    rewards: torch.Tensor  # beta x (policy - reference), detached


@dataclasses.dataclass(frozen=True)
class KTOLoss:
    loss_type: str
    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def uses_kl(self) -> bool:
        return self.loss_type == "kto"

    @property
    def description(self) -> str:
        weights = f"desirable_weight {self.desirable_weight:g}, undesirable_weight {self.undesirable_weight:g}"
        return f"{self.loss_type}, beta {self.beta:g}, {weights}"

    def __call__(self, policy: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor, kl: float) -> KTOResult:
        ratio, desirable = policy - reference, labels.bool()
        if self.loss_type == "kto":
            good, bad = 1 - torch.sigmoid(self.beta * (ratio - kl)), 1 - torch.sigmoid(self.beta * (kl - ratio))
        elif self.loss_type == "apo_zero_unpaired":
            good, bad = 1 - torch.sigmoid(self.beta * ratio), torch.sigmoid(self.beta * ratio)
        else:
            raise ValueError(f"loss_type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        loss = torch.where(desirable, self.desirable_weight * good, self.undesirable_weight * bad)
        return KTOResult(loss, (self.beta * ratio).detach())


def class_sums(result: KTOResult, policy: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's sums of the rewards and policy log-probabilities of each class (`chosen`: the good answers), on
    the device; `figure_sums` turns the step's totals into what the log shows."""
    desirable = labels.bool()
    sums = {}
    for name, mask in (("chosen", desirable), ("rejected", ~desirable)):
        # multiplied by the mask, not indexed with it: boolean indexing waits for the device
        sums[f"rewards/{name}"] = (result.rewards.detach() * mask).sum()
        sums[f"logps/{name}"] = (policy.detach() * mask).sum()
    return sums


def figure_sums(class_totals: dict, *, examples, desirable) -> dict[str, torch.Tensor]:
    """TRL's per-class figures from `class_sums` totals, scaled so that the metrics log (which divides every sum by the
    step's `examples`, all ranks) shows each as its mean over its class: `desirable` good answers in the step, all
    ranks. A class the step lacks is left out (every rank knows the global counts, so all leave out the same). Reads
    the counts: called at logging steps and in evaluation only."""
    examples, desirable = float(examples), float(desirable)
    sums = {}
    for name, count in (("chosen", desirable), ("rejected", examples - desirable)):
        if count:
            for figure in ("rewards", "logps"):
                sums[f"{figure}/{name}"] = class_totals[f"{figure}/{name}"] * (examples / count)
    if desirable and examples - desirable:
        sums["rewards/margins"] = sums["rewards/chosen"] - sums["rewards/rejected"]
    return sums


class KTOEvaluator(Evaluation):
    """Held-out KTO figures over a prepared in-order loader (None: nothing to evaluate): every row scored once
    without gradients, gathered (duplicates of an uneven split dropped), then the loss, the KL estimate over the whole
    held-out set and the per-class figures, logged as `eval_<name>`."""

    def __init__(self, accelerator, model, loader, *, reference, token_loss: TokenLoss, objective: KTOLoss, every):
        super().__init__(every=every)
        self.accelerator, self.model, self.loader, self.reference = accelerator, model, loader, reference
        self.token_loss, self.objective = token_loss, objective

    @torch.no_grad()
    def measure(self) -> dict[str, float]:
        if self.loader is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            for batch in self.loader:
                policy = sequence_log_probs(self.token_loss.token_losses(self.model, batch)).float()
                reference = self.reference(batch).float()
                count = batch["pair_index"].numel()
                values = torch.stack(
                    [policy[:count], policy[count:], reference[:count], reference[count:], batch["label"].float()], 1
                )
                parts.append(gather_for_metrics(self.accelerator, values, parallel=self.parallel))
        finally:
            self.model.train(was_training)
        policy, policy_kl, reference, reference_kl, labels = torch.cat(parts).double().unbind(1)
        kl = float(kl_estimate((policy_kl - reference_kl).sum(), labels.numel())) if self.objective.uses_kl else 0.0
        result = self.objective(policy, reference, labels, kl)
        examples, desirable = float(labels.numel()), float(labels.sum())
        totals = class_sums(result, policy, labels)
        figures = figure_sums(totals, examples=examples, desirable=desirable)
        results = {name: float(value) / examples for name, value in figures.items()}
        results.update(loss=result.loss.mean().item(), kl=kl, samples=labels.numel())
        return {f"eval_{name}": value for name, value in results.items()}
