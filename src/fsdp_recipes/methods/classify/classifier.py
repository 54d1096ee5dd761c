"""Sequence classifiers (a causal-LM or encoder body with a classification head): the model config for the data's
classes, the head, the loss and the predictions.

The loss of an optimizer step is the (class-weighted) mean over every example of the global batch, whatever its split
into ranks and micro-batches: each rank sums `weight[label] x cross-entropy` and scales by world size / (sum of the
weights of the global batch), as the token losses in `fsdp_recipes.train.losses` do with their target counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.distributed.sequence_parallel import SequenceShards
from fsdp_recipes.train import losses
from fsdp_recipes.train.checkpoint import saved_model_config_path


def configure(model_config, label_names: list[str], *, pad_token_id: int) -> None:
    """The head for these classes, and the padding id: decoder classifiers (Llama, Qwen, ...) pool the rightmost token
    that is not `pad_token_id`, and refuse batches of more than one row without it."""
    model_config.num_labels = len(label_names)
    model_config.id2label = dict(enumerate(label_names))
    model_config.label2id = {name: index for index, name in enumerate(label_names)}
    model_config.problem_type = "single_label_classification"
    model_config.pad_token_id = pad_token_id
    model_config.get_text_config().pad_token_id = pad_token_id
    if hasattr(model_config, "use_cache"):
        model_config.use_cache = False  # a classifier never decodes; a KV cache would only cost memory in training


def check_head_fits(model_config, label_names: list[str], *, ignore_mismatched_sizes: bool, source: str | None) -> None:
    """Before loading: a base that is already a classifier (its config's architecture) holds a head with a row per
    class it was trained on; data with another number of classes needs a new head, which transformers makes only with
    `ignore_mismatched_sizes` (and otherwise refuses halfway through loading). ConfigError with that fix."""
    architectures = getattr(model_config, "architectures", None) or []
    if source is None or not any(a.endswith("ForSequenceClassification") for a in architectures):
        return  # no head in the weights: a new one is made for the data's classes
    if model_config.num_labels == len(label_names) or ignore_mismatched_sizes:
        return
    saved = [model_config.id2label[i] for i in range(model_config.num_labels)] if model_config.id2label else []
    raise ConfigError(
        f"{source!r} is a classifier whose head has {model_config.num_labels} classes ({saved}), but the data has "
        f"{len(label_names)} ({label_names}). Set ignore_mismatched_sizes: true to start a new head for these "
        "classes (its trained head is dropped), or train on data with its classes"
    )


def head_module_names(model: torch.nn.Module) -> list[str]:
    """The modules outside the pretrained body (`score` for decoder classifiers, `classifier` for BERT-likes): newly
    initialised, and what LoRA must train in full (peft's `modules_to_save`)."""
    prefix = getattr(model, "base_model_prefix", None)
    return [name for name, child in model.named_children() if name != prefix and any(True for _ in child.parameters())]


def loss_sum(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    weights: torch.Tensor | None = None,
    *,
    sequence_shards: SequenceShards | None = None,
) -> torch.Tensor:
    """Sum over the batch of weight[label] x cross-entropy (weight 1 without class weights); the rows split by position
    over `sequence_shards` (the run's sequence-parallel group) when given."""
    logits = losses.sequence_classification_logits(
        model, batch["input_ids"], batch["attention_mask"], sequence_shards=sequence_shards
    )
    weights = weights.to(logits.device) if weights is not None else None
    return F.cross_entropy(logits, batch["labels"], weight=weights, reduction="sum")


def weight_sum(batch: dict[str, torch.Tensor], weights: torch.Tensor | None = None) -> torch.Tensor | float:
    """The denominator of the batch's share of the mean: its examples (a number), or the sum of their class weights
    (a tensor on the labels' device, not read)."""
    if weights is None:
        return float(batch["labels"].numel())
    labels = batch["labels"]
    return weights.to(labels.device)[labels].double().sum()


@torch.no_grad()
def predict(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per example: the predicted class, the reference, and the (unweighted) cross-entropy, for
    `evaluation.MetricEvaluator`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    return {
        "predictions": logits.argmax(-1),
        "references": batch["labels"],
        "loss": F.cross_entropy(logits, batch["labels"], reduction="none"),
    }


def check_resumed_labels(checkpoint: Path, label_names: list[str]) -> None:
    """A resumed run must see the classes it was trained on, in the same order (the head's rows are those classes)."""
    config_path = saved_model_config_path(checkpoint)
    saved = json.loads(config_path.read_text()).get("id2label", {}) if config_path.is_file() else {}
    saved_names = [saved[key] for key in sorted(saved, key=int)]
    if saved_names != label_names:
        raise DataError(
            f"the checkpoint was trained on the classes {saved_names} but this data gives {label_names}: resume with "
            "the data it was trained on, or start a new run in another output_dir"
        )


def per_class(metric, gathered: dict[str, list], label_names: list[str]) -> dict[str, float]:
    """A per-class score (e.g. the shipped `f1` with average=None) as {label name: value}, over gathered predictions."""
    values = metric.compute(
        predictions=gathered["predictions"],
        references=gathered["references"],
        average=None,
        labels=list(range(len(label_names))),
    )
    (scores,) = values.values()
    return dict(zip(label_names, scores))
