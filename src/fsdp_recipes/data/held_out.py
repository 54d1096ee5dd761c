"""Held-out data for evaluating a causal LM: rows for the mean loss (perplexity) and prompts with references for
generation metrics.

- loss: plain `text` (every token is a target), or the SFT formats (`messages`, or `prompt` and `completion`), whose
  targets are the assistant / completion tokens as SFT trains them (fsdp_recipes.data.chat);
- generation: `messages` (the last assistant turn is the reference) or `prompt` and `completion` (the reference).
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import chat, files, rows


def _chat_format(columns: list[str]) -> bool:
    return "messages" in columns or ("prompt" in columns and "completion" in columns)


def loss_rows(
    dataset: Dataset, tokenizer, *, text_column: str, max_length: int, num_proc: int | None = None
) -> tuple[Dataset, dict[str, int]]:
    """Unpacked rows (`fsdp_recipes.data.rows`) for `evaluation.evaluate_loss`, and what was truncated or dropped."""
    if len(dataset) == 0:
        raise DataError("the eval split is empty: there is nothing to evaluate")
    if _chat_format(dataset.column_names):
        tokens, stats = chat.tokenize_dataset(
            dataset,
            tokenizer,
            assistant_only_loss=True,
            completion_only_loss=True,
            max_length=max_length,
            num_proc=num_proc,
            name="eval",
        )
        return rows.build_rows(tokens, max_length=max_length, packing=False), stats
    if text_column not in dataset.column_names:
        raise DataError(
            f"the eval split has columns {sorted(dataset.column_names)}: the loss needs a {text_column!r} column "
            "(set text_column), 'messages', or 'prompt' and 'completion'"
        )

    files.check_text_column_type(dataset, text_column, split="eval", setting="text_column")

    def encode(batch):
        ids = tokenizer(batch[text_column], truncation=True, max_length=max_length)["input_ids"]
        return {"input_ids": ids, "loss_mask": [[1] * len(row) for row in ids]}

    with files.tokenizing(text_column, split="eval", setting="text_column"):
        tokens = dataset.map(
            encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc="Tokenizing eval"
        )
    with_target = tokens.filter(lambda ids: len(ids) > 1, input_columns="input_ids")  # one token predicts nothing
    if len(with_target) == 0:
        raise DataError(f"no eval text has two tokens or more in column {text_column!r}: nothing to predict")
    stats = {"examples": len(dataset), "dropped_without_loss_tokens": len(tokens) - len(with_target)}
    return rows.build_rows(with_target, max_length=max_length, packing=False), stats


def generation_examples(dataset: Dataset, tokenizer) -> list[dict[str, Any]]:
    """`{"prompt_ids", "reference", "index"}` per example, in dataset order."""
    if len(dataset) == 0:
        raise DataError("the eval split is empty: there is nothing to evaluate")
    if not _chat_format(dataset.column_names):
        raise DataError(
            f"the eval split has columns {sorted(dataset.column_names)}: generation metrics need prompts and "
            "references, as 'messages' (the last assistant turn is the reference) or 'prompt' and 'completion'"
        )
    examples = chat.generation_examples(dataset, tokenizer, len(dataset))
    return [{**example, "index": index} for index, example in enumerate(examples)]
