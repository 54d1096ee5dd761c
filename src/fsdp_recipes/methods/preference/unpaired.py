"""Unpaired feedback for KTO: single answers marked good or bad, in TRL's KTO format (`prompt`, `completion`,
`label` true/false; strings or lists of {"role", "content"} turns). Preference pairs (`prompt`/`chosen`/`rejected`, or
`chosen`/`rejected` alone) are unpaired as TRL's `unpair_preference_dataset` does: each pair gives its chosen answer
(label true) and its rejected one (label false), and the run summary says so.

Each example becomes two rows (`paired.PairCollator` with sides "completion" and "kl"): its prompt with its own
completion, and its prompt with another example's completion, a mismatched pair from which KTO estimates the KL term
(KL(policy || reference) ~ the mean over a batch of the mismatched rows' log-ratios). TRL rotates completions by one
within each device batch; here each example's partner is fixed once, by a derangement seeded with the run's seed
(example k of a seeded order takes the completion of example k - 1), so the rows of a global batch, and the estimate
over them, are the same whatever its split into ranks and micro-batches, and a resumed run sees the same rows.
"""

from __future__ import annotations

import random
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import chat, files, images
from fsdp_recipes.data.rows import shifted_targets
from fsdp_recipes.methods.preference import paired

COLUMNS = ("prompt", "completion", "label")
SIDES = ("completion", "kl")


def unpair_if_paired(dataset: Dataset, name: str) -> tuple[Dataset, str | None]:
    """(the dataset in KTO's format, a note for the run summary when it was preference pairs)."""
    columns = dataset.column_names
    if all(column in columns for column in COLUMNS):
        return dataset, None
    try:
        data_format = paired.detect_format(columns)
    except DataError:
        raise DataError(
            f"the {name} split has columns {sorted(columns)}, but KTO needs 'prompt', 'completion' and 'label' (true "
            "for a good answer, false for a bad one), or preference pairs ('prompt', 'chosen', 'rejected'), which are "
            "unpaired. Rename the columns (e.g. dataset.rename_column) or convert the data."
        ) from None
    prompts, chosen_answers, rejected_answers = [], [], []
    carving = files.carving_of(dataset)
    for index, example in enumerate(dataset):
        if data_format == "explicit":
            prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
        else:
            try:
                prompt, chosen, rejected = paired.split_implicit_prompt(example["chosen"], example["rejected"])
            except ValueError as error:
                raise DataError(
                    f"pair {files.row_place(carving, index, name)}: {error}. Fix or remove that pair."
                ) from None
        prompts.append(prompt)
        chosen_answers.append(chosen)
        rejected_answers.append(rejected)
    prompts, completions = prompts + prompts, chosen_answers + rejected_answers  # as TRL: the chosen, then the rejected
    labels = [True] * len(dataset) + [False] * len(dataset)
    shown = {name: list(dataset[name]) * 2 for name in images.IMAGE_COLUMNS if name in columns}  # both answers' prompt
    unpaired = Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels, **shown})
    note = (
        f"{len(dataset)} preference pairs unpaired into {len(unpaired)} examples (chosen: label true, rejected: "
        "label false), as TRL's unpair_preference_dataset does"
    )
    return unpaired, note


def kl_partners(count: int, seed: int) -> list[int]:
    """partner[i]: the example whose completion is paired with example i's prompt in its KL row (never i itself when
    there are two examples or more)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    partners = [0] * count
    for position, example in enumerate(order):
        partners[example] = order[position - 1]
    return partners


def _tokenize(
    example, index, tokenizer, *, partner, max_length, max_prompt_length, where, pictures=None, column=None, roots=()
) -> dict[str, Any]:
    prompt, completion, label = example["prompt"], example["completion"], example["label"]
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: label must be true (a good answer) or false (a bad one), got "
            f"{label!r}. Convert the column to booleans."
        )
    kinds = {type(prompt), type(completion), type(partner)}
    if kinds not in ({str}, {list}):
        raise DataError(
            f"{where}: 'prompt' and 'completion' must be strings or lists of turns, all "
            "examples alike. Fix or remove that example."
        )
    if isinstance(completion, list):
        problem = chat.conversation_problem(prompt + completion, "completion", assistant_from=len(prompt))
    else:
        problem = None if completion.strip() else f"'completion' is {'only whitespace' if completion else 'empty'}"
    data, shown = [], []
    if problem is None and column is not None:  # the prompt's pictures, in both rows (the KL row's too)
        try:
            data, shown = paired.pictures_of(example, prompt, dict(zip(SIDES, (completion, partner))), column, roots)
        except ValueError as error:
            problem = str(error)
    if problem:
        raise DataError(f"{where}: {problem}. Fix or remove that example.")
    row: dict[str, Any] = {"index": index, "label": label}
    for side, answer in zip(SIDES, (completion, partner)):
        try:
            ids, mask = paired.tokenize_side(
                tokenizer, prompt, answer, max_length=max_length, max_prompt_length=max_prompt_length,
                pictures=pictures, shown=shown,
            )  # fmt: skip
        except ValueError as error:  # a cut through a picture
            raise DataError(f"{where}: {error}. Fix or remove that example.") from None
        if side == "completion" and sum(mask[1:]) == 0:
            raise DataError(
                f"{where}: its completion has no token left after truncation to "
                f"max_length={max_length}. Raise max_length, set (or lower) max_prompt_length, or remove it."
            )
        row[f"{side}_input_ids"], row[f"{side}_targets"] = ids, shifted_targets(ids, mask)
    row["length"] = max(len(row["completion_input_ids"]), len(row["kl_input_ids"]))
    if column is not None:
        row["images"] = data
    row["key"] = paired.content_key(row, SIDES)
    return row


def tokenize_examples(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    seed: int,
    max_prompt_length: int | None = None,
    num_proc: int | None = None,
    name: str = "train",
    pictures: images.ImageInputs | None = None,
    image_roots: tuple = (),
) -> tuple[Dataset, dict[str, Any]]:
    """Examples as `completion_input_ids`/`completion_targets` (the example), `kl_input_ids`/`kl_targets` (its prompt
    with its partner's completion), `label`, `index`, `key` (`paired.content_key` of both rows) and `length`,
    with counts for the run summary. DataError when a split has one class only (train) or labels that are not
    booleans. With an `images` (or `image`) column, `pictures` (the model's processor) expands the prompt's image
    parts in both rows, which keep the pictures' bytes (`images`)."""
    if len(dataset) == 0:
        raise DataError(f"the {name} split is empty: there is nothing to train or evaluate on")
    carving, pair_count = files.carving_of(dataset), len(dataset)
    dataset, note = unpair_if_paired(dataset, name)
    column = images.image_column(dataset.column_names)
    images.require_reader(column, pictures, name)

    def where(index: int) -> str:
        """Example `index`, as the user's data numbers it (pairs unpaired: the chosen ones, then the rejected)."""
        if note is None:
            return f"example {files.row_place(carving, index, name)}"
        side = "chosen" if index < pair_count else "rejected"
        return f"the {side} answer of pair {files.row_place(carving, index % pair_count, name)}"

    if len(dataset) < 2:
        raise DataError(f"the {name} split has one example: KTO's KL estimate pairs each prompt with another answer")
    if isinstance(dataset[0]["completion"], list) and not tokenizer.chat_template:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so conversations cannot be formatted. Set "
            "chat_template in the recipe config to a Jinja template (a path to a .jinja file or the text itself)."
        )
    labels = dataset["label"]
    desirable = sum(1 for label in labels if label is True)
    undesirable = sum(1 for label in labels if label is False)
    if name == "train" and desirable + undesirable == len(labels) and not (desirable and undesirable):
        only = "desirable (label true)" if desirable else "undesirable (label false)"
        raise DataError(
            f"the {name} split holds only {only} examples: KTO weighs good answers against bad ones, and its KL "
            "estimate and desirable_weight/undesirable_weight mean nothing with one kind. Add examples of the other "
            "kind (or train the good answers with recipes/sft.py)"
        )
    completions = dataset["completion"]
    partners = kl_partners(len(dataset), seed)
    examples = dataset.map(
        lambda example, index: _tokenize(
            example,
            index,
            tokenizer,
            partner=completions[partners[index]],
            max_length=max_length,
            max_prompt_length=max_prompt_length,
            where=where(index),
            pictures=pictures,
            column=column,
            roots=tuple(image_roots),
        ),
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {name} examples",
    )
    lengths = examples["length"]
    stats = {
        "examples": len(examples),
        "desirable": desirable,
        "undesirable": undesirable,
        "longest_row": max(lengths),
        "mean_row_tokens": round(sum(lengths) / len(lengths), 1),
    }
    if note:
        stats["unpaired"] = note
    return examples, stats


def collator(pad_token_id: int, pictures=None) -> paired.PairCollator:
    """B examples -> 2B rows (the examples, then their KL rows), `pair_index`, `pair_key` and `label`; rows showing
    pictures get their pixel values from `pictures` (the model's processor)."""
    return paired.PairCollator(pad_token_id, sides=SIDES, per_example=("label",), pictures=pictures)
