"""Reward models: a sequence classifier with one output scoring a whole answer, trained on preference pairs with the
Bradley-Terry loss (TRL's RewardTrainer semantics; names as its RewardConfig).

A pair's loss is `-log sigmoid(r_chosen - r_rejected - margin)` (margin: an optional per-pair column saying by how much
the chosen answer should win, 0 without it), plus `center_rewards_coefficient x (r_chosen + r_rejected)^2`, which keeps
rewards centred on zero. A step's loss is the mean over every pair of the global batch whatever its split into ranks
and micro-batches: each rank sums its pairs' losses and scales by world size / global pair count (as the token losses of
`fsdp_recipes.train.losses` do with their target counts).

A batch of B pairs is 2B rows, the chosen rows then the rejected ones (`preference.PairCollator`), so one forward
scores both; rows are right-padded and the model pools its last real token (transformers finds it from
`pad_token_id`, which `configure` sets).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.data import files
from fsdp_recipes.distributed.sequence_parallel import SequenceShards
from fsdp_recipes.methods.preference.paired import PairCollator
from fsdp_recipes.train import losses

LABEL = "reward"  # the one output's name in config.id2label (what pipeline("text-classification") reports)
MARGIN_COLUMN = "margin"


def configure(model_config, *, pad_token_id: int) -> None:
    """One output, read as a raw score: problem_type "regression" makes pipeline("text-classification") return it
    without a sigmoid; pad_token_id lets decoder classifiers find each row's last real token."""
    model_config.num_labels = 1
    model_config.id2label = {0: LABEL}
    model_config.label2id = {LABEL: 0}
    model_config.problem_type = "regression"
    model_config.pad_token_id = pad_token_id
    model_config.get_text_config().pad_token_id = pad_token_id
    if hasattr(model_config, "use_cache"):
        model_config.use_cache = False


def check_head(model_config, *, ignore_mismatched_sizes: bool, source: str | None) -> None:
    """Before loading: a base that is already a sequence classifier carries a head with `num_labels` outputs; a reward
    model has one. ConfigError with the fix when they differ (transformers would refuse halfway through loading)."""
    architectures = getattr(model_config, "architectures", None) or []
    if source is None or not any(a.endswith("ForSequenceClassification") for a in architectures):
        return  # a causal LM or a bare body: the one-output head is new
    if model_config.num_labels == 1 or ignore_mismatched_sizes:
        return
    raise ConfigError(
        f"{source!r} is a sequence classifier with num_labels={model_config.num_labels} (its config.json), but a "
        "reward model has one output. Set ignore_mismatched_sizes: true to start a new one-output head (the trained "
        "head is dropped, the body kept), or start from a causal LM or a one-label reward model"
    )


def add_margins(pairs: Dataset, raw: Dataset, *, name: str) -> tuple[Dataset, bool]:
    """The raw data's `margin` column (finite numbers, one per pair) beside the tokenised pairs, and whether it was
    there; 0 for every pair without the column."""
    if MARGIN_COLUMN not in raw.column_names:
        return pairs.add_column(MARGIN_COLUMN, [0.0] * len(pairs)), False
    margins = raw[MARGIN_COLUMN]
    for index, value in enumerate(margins):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(
                f"pair {files.row_place(files.carving_of(raw), index, name)}: its {MARGIN_COLUMN!r} is {value!r}, not a finite number. Fix "
                f"that value, or remove the {MARGIN_COLUMN!r} column (no margin)"
            )
    return pairs.add_column(MARGIN_COLUMN, [float(value) for value in margins]), True


class RewardCollator:
    """B pairs -> `preference.PairCollator`'s 2B right-padded rows, with the attention mask of each row's real tokens
    and each pair's `margin`. Picklable, for DataLoader workers."""

    def __init__(self, pad_token_id: int):
        self.pairs = PairCollator(pad_token_id)

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pairs(pairs)
        width = batch["input_ids"].shape[1]
        batch["attention_mask"] = (torch.arange(width)[None, :] < batch["real_tokens"][:, None]).long()
        batch["margin"] = torch.tensor([float(pair.get(MARGIN_COLUMN, 0.0)) for pair in pairs], dtype=torch.float32)
        return batch


def rewards(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, sequence_shards: SequenceShards | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores in fp32, one per pair, from one forward over the batch's 2B rows (split by position
    over `sequence_shards`, the run's sequence-parallel group, when given: `losses.sequence_classification_logits`)."""
    scores = losses.sequence_classification_logits(
        model, batch["input_ids"], batch["attention_mask"], sequence_shards=sequence_shards
    )
    return scores.squeeze(-1).chunk(2)


def bradley_terry_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> torch.Tensor:
    """Per-pair loss: -log sigmoid(chosen - rejected - margin) + center_rewards_coefficient x (chosen + rejected)^2."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def metric_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the pairs (means once divided by the global pair count, by the metrics log): how often the chosen
    answer scores higher, by how much, and the scores. Kept on the device until a logging step reads them."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "accuracy": (chosen > rejected).float().sum(),
        "margin": (chosen - rejected).sum(),
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
    }


def make_predict(center_rewards_coefficient: float, *, sequence_shards: SequenceShards | None = None):
    """`predict` for `evaluation.MetricEvaluator`: per held-out pair its loss (with its margin), whether the chosen
    answer scores higher (eval_accuracy), by how much (eval_margin) and both scores (`sequence_shards`: as `rewards`)."""

    @torch.no_grad()
    def predict(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        chosen, rejected = rewards(model, batch, sequence_shards=sequence_shards)
        losses = bradley_terry_losses(
            chosen, rejected, margin=batch["margin"], center_rewards_coefficient=center_rewards_coefficient
        )
        return {
            "loss": losses,
            "accuracy": (chosen > rejected).float(),
            "margin": chosen - rejected,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
        }

    return predict
