"""Classification data: a text column (and optionally a text-pair column) and a label column, whose values are a
`ClassLabel`, integers or strings.

Label ids come from the training split: a ClassLabel keeps its own names and ids; integers and strings become the
sorted distinct values seen in training, named by their text. The names go into the model's `config.id2label`, so the
exported folder answers with them. Held-out labels must be among them: a model cannot be scored on a class it never
had a head row for.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import ClassLabel, Dataset

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import files


def check_columns(
    dataset: Dataset, *, text_column: str, text_pair_column: str | None, label_column: str | None, name: str
) -> None:
    if len(dataset) == 0:
        raise DataError(f"the {name} split is empty: there is nothing to train or evaluate on")
    needed = [text_column] + ([text_pair_column] if text_pair_column else []) + ([label_column] if label_column else [])
    missing = [column for column in needed if column not in dataset.column_names]
    if missing:
        raise DataError(
            f"the {name} split has columns {sorted(dataset.column_names)} but no {', '.join(map(repr, missing))}: set "
            "text_column, text_pair_column and label_column to the dataset's column names (or rename its columns)"
        )
    for column in needed:
        empty = sum(value is None for value in dataset[column])
        if empty:
            raise DataError(f"{empty} rows of the {name} split have no value in column {column!r}: drop or fill them")
    for column, setting in ((text_column, "text_column"), (text_pair_column, "text_pair_column")):
        if column:
            files.check_text_column_type(dataset, column, split=name, setting=setting)


def _texts_of(dataset: Dataset, column: str) -> list[str]:
    feature = dataset.features[column]
    if isinstance(feature, ClassLabel):
        values = dataset[column]
        unlabelled = sum(not 0 <= value < feature.num_classes for value in values)
        if unlabelled:
            raise DataError(
                f"{unlabelled} rows have no label in column {column!r} (ClassLabel value -1, as in the test splits of "
                "GLUE-style datasets): evaluate on a labelled split (e.g. validation), or drop those rows"
            )
        return [feature.names[value] for value in values]
    values = dataset[column]
    if any(isinstance(value, (bool, float)) or not isinstance(value, (int, str)) for value in values):
        kinds = sorted({type(value).__name__ for value in values})
        raise DataError(f"labels in column {column!r} are {'/'.join(kinds)}: use a ClassLabel, integers or strings")
    return [str(value) for value in values]


def label_names(train: Dataset, label_column: str) -> list[str]:
    """The classes, in id order: a ClassLabel's names, else the sorted distinct values of the training split (integers
    in numeric order). At least two must occur in training."""
    feature = train.features[label_column]
    present = sorted(set(_texts_of(train, label_column)))
    if len(present) < 2:
        raise DataError(
            f"the training split has a single label ({present[0]!r} in column {label_column!r}): a classifier needs "
            "examples of at least two classes. Check label_column and the data."
        )
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if all(isinstance(value, int) for value in train[label_column]):
        return [str(value) for value in sorted({int(value) for value in present})]
    return present


def label_ids(
    dataset: Dataset, label_column: str, label2id: dict[str, int], *, name: str, ids_allowed: bool = False
) -> list[int]:
    """Each row's label id, by label name (case-insensitively if need be). `ids_allowed`: a model whose classes have
    no real names (transformers' LABEL_0, LABEL_1, ...) takes integer labels as ids."""
    texts = _texts_of(dataset, label_column)
    folded = {label.lower(): index for label, index in label2id.items()}
    unknown = sorted({text for text in texts if text not in label2id and text.lower() not in folded})
    if not unknown:
        return [label2id[text] if text in label2id else folded[text.lower()] for text in texts]
    feature = dataset.features[label_column]
    raw = dataset[label_column]
    if ids_allowed and all(isinstance(value, int) and 0 <= value < len(label2id) for value in raw):
        return list(raw)
    shown = ", ".join(repr(text) for text in unknown[:5]) + (
        f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    )
    kind = "ClassLabel " if isinstance(feature, ClassLabel) else ""
    raise DataError(
        f"the {name} split has {kind}labels the classifier does not know: {shown} (known: "
        f"{', '.join(sorted(label2id))}). Every {name} label must occur in the training data (or be one of the "
        "model's id2label names): fix the labels or drop those rows."
    )


def tokenize(
    dataset: Dataset,
    tokenizer,
    *,
    text_column: str,
    text_pair_column: str | None,
    labels: list[int],
    max_length: int,
    num_proc: int | None = None,
    name: str = "train",
) -> tuple[Dataset, dict[str, int]]:
    """`input_ids` (text, or text and pair as the tokenizer joins them, truncated to max_length) and `labels`."""

    special = tokenizer.num_special_tokens_to_add(pair=text_pair_column is not None)
    if max_length < special + 1 + (text_pair_column is not None):
        raise DataError(
            f"max_length={max_length} leaves no token of the text: the tokenizer adds {special} special token(s) to "
            f"each example{' (with its pair)' if text_pair_column else ''}. Raise max_length (the texts' usual length "
            "in tokens is a good value)"
        )

    def encode(batch):
        pairs = batch[text_pair_column] if text_pair_column else None
        encoded = tokenizer(batch[text_column], pairs, truncation=True, max_length=max_length)
        full = tokenizer(batch[text_column], pairs)["input_ids"]
        return {"input_ids": encoded["input_ids"], "truncated": [len(ids) > max_length for ids in full]}

    with files.tokenizing(text_column, split=name, setting="text_column"):
        tokenized = dataset.map(
            encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=f"Tokenizing {name}"
        )
    stats = {"examples": len(dataset), "truncated": int(sum(tokenized["truncated"]))}
    return tokenized.remove_columns("truncated").add_column("labels", list(labels)), stats


def rows_for_trained_classes(
    dataset: Dataset,
    tokenizer,
    id2label: dict[int, str],
    *,
    text_column: str,
    text_pair_column: str | None,
    label_column: str,
    max_length: int,
    num_proc: int | None = None,
    name: str = "eval",
) -> Dataset:
    """Rows for a classifier that already has its classes (`id2label`, as evaluating one does): the columns checked,
    each label read by the class's name, or as an id when the model names none (transformers' LABEL_0, ...)."""
    columns = dict(text_column=text_column, text_pair_column=text_pair_column)
    check_columns(dataset, **columns, label_column=label_column, name=name)
    label2id = {label: int(index) for index, label in id2label.items()}
    unnamed = all(label == f"LABEL_{index}" for label, index in label2id.items())
    labels = label_ids(dataset, label_column, label2id, name=name, ids_allowed=unnamed)
    rows, _ = tokenize(
        dataset, tokenizer, **columns, labels=labels, max_length=max_length, num_proc=num_proc, name=name
    )
    return rows


def class_weights(labels: list[int], num_labels: int, spec: str | None) -> torch.Tensor | None:
    """The loss weight of each class: None (plain cross-entropy); "balanced": n / (classes x n_class) over the training
    labels, so every class weighs as much in total (a class absent from training gets 0); or "w0,w1,..." by id."""
    if spec is None:
        return None
    if spec == "balanced":
        counts = torch.bincount(torch.tensor(labels), minlength=num_labels).double()
        present = int((counts > 0).sum())
        return torch.where(counts > 0, len(labels) / (present * counts.clamp(min=1)), 0.0).float()
    weights = [float(value) for value in spec.split(",")]
    if len(weights) != num_labels:
        raise DataError(
            f"class_weights gives {len(weights)} weights but the data has {num_labels} classes: give one "
            "per class, in label-id order (the run summary lists the labels), or use 'balanced'"
        )
    return torch.tensor(weights)


def collate(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` with their `attention_mask`, `labels`, and `real_tokens` for the throughput figures.
    Decoder classifiers pool the rightmost token that is not padding, which right padding leaves in place."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = [list(row["input_ids"]) + [pad_token_id] * (width - len(row["input_ids"])) for row in rows]
    mask = [[1] * len(row["input_ids"]) + [0] * (width - len(row["input_ids"])) for row in rows]
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "labels": torch.tensor([row["labels"] for row in rows], dtype=torch.long),
        "real_tokens": torch.tensor([len(row["input_ids"]) for row in rows], dtype=torch.long),
    }


class Collator:
    """Picklable collate_fn for DataLoader workers."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows):
        return collate(rows, self.pad_token_id)


def eval_dataloader(rows: Dataset, *, batch_size: int, pad_token_id: int) -> torch.utils.data.DataLoader:
    """Held-out rows in dataset order; `accelerator.prepare` splits it across ranks."""
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=Collator(pad_token_id))
