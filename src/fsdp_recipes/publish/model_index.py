"""Evaluation results in a model card's `model-index`, the metadata the Hub shows as results on a model's page, and
a table of the same results in the card's text.

A recipe's results (`eval_accuracy`, `eval_rouge1`, ...) become `huggingface_hub.EvalResult`s; `update_card` merges
them into a folder's README.md (written if missing), replacing earlier results for the same task, dataset, split and
metric and keeping the rest.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

# result name -> (Hub metric id, display name, metric arguments)
_KNOWN = {
    "accuracy": ("accuracy", "Accuracy", None),
    "f1": ("f1", "F1 (macro)", {"average": "macro"}),
    "precision": ("precision", "Precision (macro)", {"average": "macro"}),
    "recall": ("recall", "Recall (macro)", {"average": "macro"}),
    "exact_match": ("exact_match", "Exact match", None),
    "rouge1": ("rouge", "ROUGE-1", None),
    "rouge2": ("rouge", "ROUGE-2", None),
    "rougeL": ("rouge", "ROUGE-L", None),
    "rougeLsum": ("rouge", "ROUGE-Lsum", None),
    "sacrebleu": ("sacrebleu", "BLEU (sacrebleu)", None),
    "chrf": ("chrf", "chrF", None),
    "perplexity": ("perplexity", "Perplexity", None),
    "loss": ("loss", "Mean loss", None),
}
_NOT_RESULTS = {"samples"}
_TASK_NAMES = {"text-classification": "Text Classification", "text-generation": "Text Generation"}
_START, _END = "<!-- fsdp-recipes:evaluation -->", "<!-- /fsdp-recipes:evaluation -->"


def dataset_id(dataset: str) -> str:
    """The Hub id of a dataset, or the file or folder name of local data (which has none)."""
    return Path(dataset).name if Path(dataset).exists() else dataset


def eval_results(
    results: dict[str, Any], *, task: str, dataset: str, dataset_config: str | None = None, split: str | None = None
) -> list[EvalResult]:
    """One EvalResult per number in `results` (keys with or without the `eval_` prefix); lists, texts and the
    example count are not results. `task` is the Hub pipeline tag (text-classification, text-generation)."""
    found = []
    for key, value in results.items():
        name = key.removeprefix("eval_")
        if name in _NOT_RESULTS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        metric_type, metric_name, metric_args = _KNOWN.get(name, (name, name, None))
        found.append(
            EvalResult(
                task_type=task,
                task_name=_TASK_NAMES.get(task),
                dataset_type=dataset_id(dataset),
                dataset_name=dataset_id(dataset),
                dataset_config=dataset_config,
                dataset_split=split,
                metric_type=metric_type,
                metric_name=metric_name,
                metric_args=metric_args,
                metric_value=float(value),
            )
        )
    return found


def _key(result: EvalResult) -> tuple:
    return (
        result.task_type,
        result.dataset_type,
        result.dataset_config,
        result.dataset_split,
        result.metric_type,
        result.metric_name,
    )


def results_table(results: list[EvalResult]) -> str:
    rows = [
        f"| {r.dataset_name} | {r.dataset_split or ''} | {r.metric_name or r.metric_type} | {r.metric_value:.4g} |"
        for r in results
    ]
    return "| dataset | split | metric | value |\n|---|---|---|---|\n" + "\n".join(rows)


def merge_eval_results(card: ModelCard, results: list[EvalResult], *, model_name: str) -> list[EvalResult]:
    """Into the card's metadata only: `results` replace earlier ones for the same task, dataset, split and metric,
    the others are kept. Returns the merged list."""
    new_keys = {_key(result) for result in results}
    merged = [r for r in (card.data.eval_results or []) if _key(r) not in new_keys] + list(results)
    card.data.eval_results = merged
    card.data.model_name = card.data.model_name or model_name
    return merged


def update_card(
    folder: str | Path, results: list[EvalResult], *, model_name: str, pipeline_tag: str, base_model: str | None = None
) -> Path:
    """Merges `results` into `folder/README.md`'s model-index (writing a short card if there is none) and rewrites
    the card's evaluation table from the merged results."""
    path = Path(folder) / "README.md"
    if path.is_file():
        card = ModelCard.load(path)
    else:
        data = ModelCardData(
            library_name="transformers", pipeline_tag=pipeline_tag, tags=["fsdp-recipes"], base_model=base_model
        )
        card = ModelCard(
            f"---\n{data.to_yaml()}\n---\n\n# {model_name}\n\nEvaluated with the FSDP Recipes `eval` recipe.\n"
        )
    merged = merge_eval_results(card, results, model_name=model_name)
    section = f"{_START}\n## Evaluation\n\n{results_table(merged)}\n{_END}"
    if _START in card.text and _END in card.text:
        before, rest = card.text.split(_START, 1)
        card.text = before + section + rest.split(_END, 1)[1]
    else:
        card.text = card.text.rstrip() + "\n\n" + section + "\n"
    card.save(path)
    return path
