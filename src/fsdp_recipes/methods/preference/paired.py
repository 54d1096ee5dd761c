"""Preference pairs for DPO: the formats TRL's DPO accepts, recognised by their columns, tokenised into a chosen and a
rejected row per pair that share the prompt and carry loss on their completion only.

- explicit prompt: `prompt`, `chosen`, `rejected`: strings, or lists of {"role", "content"} turns (the prompt's
  turns, then the assistant turn(s) of each answer), formatted with the tokenizer's chat template;
- implicit prompt: `chosen` and `rejected` only (whole texts or whole conversations): the prompt is what they share,
  the leading turns of two conversations or the common start of two strings.

A batch of B pairs is 2B rows (`PairCollator`): the B chosen rows, then the B rejected ones, so one forward pass
scores both; `pair_index` says which pair each of the first B rows is, and `pair_key` what it holds: a hash of its
token ids and targets, by which precomputed reference values are found (an edited pair gets another key, so a value
is never given to a pair it was not computed for).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from datasets import Dataset
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import files, images
from fsdp_recipes.data.chat import conversation_problem, tokenize_example
from fsdp_recipes.data.chat_masks import TemplatePrefixError
from fsdp_recipes.data.rows import collate_rows, shifted_targets

FORMATS = {"explicit": ("prompt", "chosen", "rejected"), "implicit": ("chosen", "rejected")}


def detect_format(column_names: list[str]) -> str:
    if all(column in column_names for column in FORMATS["explicit"]):
        return "explicit"
    if all(column in column_names for column in FORMATS["implicit"]):
        return "implicit"
    raise DataError(
        f"the dataset has columns {sorted(column_names)}, but preference tuning needs 'prompt', 'chosen' and 'rejected' "
        "columns, or 'chosen' and 'rejected' alone (the prompt is then what they share). Each holds strings or lists "
        "of {'role', 'content'} turns. Rename the columns (e.g. dataset.rename_column) or convert the data."
    )


def split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen completion, rejected completion) from two whole texts or conversations: the turns both start
    with (up to the last user turn before they differ), or the characters both start with."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        while shared > 0 and chosen[shared - 1].get("role") == "assistant":  # answers start at an assistant turn
            shared -= 1
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = len(os.path.commonprefix([chosen, rejected]))
        return chosen[:shared], chosen[shared:], rejected[shared:]
    raise ValueError("'chosen' and 'rejected' must both be strings or both lists of turns")


def pair_problem(prompt: Any, chosen: Any, rejected: Any, *, implicit: bool = False) -> str | None:
    """What makes a pair unusable, or None. An empty answer is one: it would train on the end-of-text token alone."""
    kinds = {type(value) for value in (prompt, chosen, rejected)}
    if kinds not in ({str}, {list}):
        return (
            "'prompt', 'chosen' and 'rejected' must all be strings or all lists of turns, got "
            f"{', '.join(type(v).__name__ for v in (prompt, chosen, rejected))}"
        )
    for column, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, str) and not answer.strip() and chosen != rejected:
            other = "rejected" if column == "chosen" else "chosen"
            return f"{column!r} is {'only whitespace' if answer else 'empty'}" + (
                f": all of it is the start of {other!r}, so it is taken as the prompt" if implicit else ""
            )
    if isinstance(chosen, list):
        for column, answer in (("chosen", chosen), ("rejected", rejected)):
            problem = conversation_problem(prompt + answer, column, assistant_from=len(prompt))
            if problem:
                return problem
    if chosen == rejected:
        return "'chosen' and 'rejected' are the same: the pair prefers nothing"
    return None


def tokenize_side(
    tokenizer, prompt, completion, *, max_length: int, max_prompt_length: int | None, pictures=None, shown=()
) -> tuple[list[int], list[int]]:
    """Tokens and loss mask of prompt + completion: the prompt cut from the left to max_prompt_length, then the
    whole cut from the right to max_length. With `shown` (the pictures of its image parts, opened) and `pictures`
    (the model's processor, data.images.ImageInputs) each placeholder becomes its picture's tokens, never targets;
    ValueError when a cut would take part of a picture."""
    tokens = tokenize_example(
        {"prompt": prompt, "completion": completion},
        tokenizer,
        "prompt_completion",
        assistant_only_loss=True,
        completion_only_loss=True,
        max_length=1 << 30,
        rewriting_templates=True,
    )
    ids, mask = tokens["input_ids"], tokens["loss_mask"]
    if shown:
        ids, mask = pictures.expand(ids, mask, list(shown))
    prompt_length = next((i for i, keep in enumerate(mask) if keep), len(mask))
    if max_prompt_length is not None and prompt_length > max_prompt_length:
        cut = prompt_length - max_prompt_length
        if shown and pictures.first_image_token(ids) < cut:
            raise ValueError(
                f"its prompt takes {prompt_length} tokens with its images, and max_prompt_length={max_prompt_length} "
                "would cut a picture (the prompt is cut from the left): raise max_prompt_length, or shrink the images' "
                "resolution in the processor"
            )
        ids, mask = ids[cut:], mask[cut:]
    if shown and (last := pictures.last_image_token(ids)) >= max_length:
        raise ValueError(
            f"its last image ends at token {last + 1}, past max_length={max_length}: raise max_length, or shrink the "
            "images' resolution in the processor"
        )
    return ids[:max_length], mask[:max_length]


def tokenize_pair(
    example: dict[str, Any],
    index: int,
    tokenizer: PreTrainedTokenizerBase,
    *,
    data_format: str,
    max_length: int,
    max_prompt_length: int | None,
    name: str,
    carving: files.Carving | None = None,
    pictures: images.ImageInputs | None = None,
    image_column: str | None = None,
    image_roots: tuple = (),
) -> dict[str, Any]:
    where = f"pair {files.row_place(carving, index, name)}"
    if data_format == "explicit":
        prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
        if isinstance(prompt, str) and isinstance(chosen, list) and isinstance(rejected, list):
            # UltraFeedback's layout (HuggingFaceH4/ultrafeedback_binarized): the prompt as text, and conversations
            # that repeat it as their first turn; their shared turns are the prompt (a user turn if they share none)
            shared, chosen, rejected = split_implicit_prompt(chosen, rejected)
            prompt = shared or [{"role": "user", "content": prompt}]
    else:
        try:
            prompt, chosen, rejected = split_implicit_prompt(example["chosen"], example["rejected"])
        except ValueError as error:
            raise DataError(f"{where}: {error}. Fix or remove that pair.") from None
    problem = pair_problem(prompt, chosen, rejected, implicit=data_format == "implicit")
    data, shown = [], []
    if problem is None and image_column is not None:
        try:
            answers = {"chosen": chosen, "rejected": rejected}
            data, shown = pictures_of(example, prompt, answers, image_column, image_roots)
        except ValueError as error:
            problem = str(error)
    if problem is None:
        try:
            sides = [
                tokenize_side(
                    tokenizer, prompt, answer, max_length=max_length, max_prompt_length=max_prompt_length,
                    pictures=pictures, shown=shown,
                )
                for answer in (chosen, rejected)
            ]  # fmt: skip
        except TemplatePrefixError as error:  # the template's reason, with the fix that applies here
            raise DataError(
                f"{where}: {error.reason}. Use a template that renders each turn as written (set chat_template in "
                "the recipe config to a Jinja template), or fix or remove that pair."
            ) from None
        except TemplateError as error:
            problem = f"the chat template refused it: {error}"
        except ValueError as error:  # a cut through a picture
            problem = str(error)
    if problem is not None:
        raise DataError(f"{where}: {problem}. Fix or remove that pair.")
    row: dict[str, Any] = {"index": index}
    for side, (ids, mask) in zip(("chosen", "rejected"), sides):
        if sum(mask[1:]) == 0:
            raise DataError(
                f"{where}: its {side} answer has no token left after truncation to "
                f"max_length={max_length}"
                + (f" with max_prompt_length={max_prompt_length}" if max_prompt_length else "")
                + ". Raise max_length, set (or lower) max_prompt_length, or remove that pair."
            )
        row[f"{side}_input_ids"] = ids
        row[f"{side}_targets"] = shifted_targets(ids, mask)
    row["length"] = max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))
    if image_column is not None:
        row["images"] = data
    row["key"] = content_key(row)
    return row


def pictures_of(example, prompt, answers: dict[str, Any], column: str, roots) -> tuple[list[bytes], list]:
    """An example's pictures (their bytes, and opened), checked against the image parts of the prompt and each of
    its `answers` ({side: answer}). ValueError says what does not match."""
    given = images.images_of(example, column)
    for side, answer in answers.items():
        parts = images.image_parts(prompt + answer) if isinstance(answer, list) else 0
        if parts != len(given):
            raise ValueError(
                f"its prompt and {side} answer have {parts} image part(s) but {len(given)} image(s) in {column!r}"
                + ("" if isinstance(answer, list) else ": pictures need conversational turns with image parts")
            )
    data = [images.image_bytes(value, roots) for value in given]
    return data, [images.open_image(one) for one in data]


def content_key(pair: dict[str, Any], sides: tuple[str, str] = ("chosen", "rejected")) -> int:
    """A signed 64-bit hash of what a pair's reference values depend on: both rows' token ids and targets, and its
    pictures (two pictures of one size have the same tokens)."""
    content = json.dumps(
        [list(pair[f"{side}_{part}"]) for side in sides for part in ("input_ids", "targets")], separators=(",", ":")
    )
    digest = hashlib.blake2b(content.encode(), digest_size=8)
    for picture in pair.get("images") or []:
        digest.update(hashlib.blake2b(picture).digest())
    return int.from_bytes(digest.digest(), "little", signed=True)


def tokenize_pairs(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    num_proc: int | None = None,
    name: str = "train",
    pictures: images.ImageInputs | None = None,
    image_roots: tuple = (),
) -> tuple[Dataset, dict[str, Any]]:
    """Pairs as `chosen_input_ids`, `chosen_targets`, `rejected_input_ids`, `rejected_targets` (targets shifted,
    IGNORE_INDEX outside the completion), `index` (the pair's position in `dataset`), `key` (`content_key`) and
    `length` (the longer row), with counts for the run summary. With an `images` (or `image`) column, `pictures`
    (the model's processor) expands the prompt's image parts, and the pairs keep the pictures' bytes (`images`)."""
    if len(dataset) == 0:
        raise DataError(f"the {name} split is empty: there is nothing to train or evaluate on")
    data_format = detect_format(dataset.column_names)
    image_column = images.image_column(dataset.column_names)
    images.require_reader(image_column, pictures, name)
    first = dataset[0]["chosen"]
    if isinstance(first, list) and not tokenizer.chat_template:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so conversations cannot be formatted. Set "
            "chat_template in the recipe config to a Jinja template (a path to a .jinja file or the text itself)."
        )
    pairs = dataset.map(
        tokenize_pair,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            data_format=data_format,
            max_length=max_length,
            max_prompt_length=max_prompt_length,
            name=name,
            carving=files.carving_of(dataset),
            pictures=pictures,
            image_column=image_column,
            image_roots=tuple(image_roots),
        ),
        desc=f"Tokenizing {name} pairs",
    )
    lengths = pairs["length"]
    stats = {
        "pairs": len(pairs),
        "format": data_format,
        "longest_row": max(lengths),
        "mean_row_tokens": round(sum(lengths) / len(lengths), 1),
    }
    return pairs, stats


def count_pairs(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["pair_index"].numel())


class PairCollator:
    """B pairs -> 2B right-padded rows (the chosen rows, then the rejected ones), `pair_index` and `pair_key`.
    Picklable, for DataLoader workers. Other two-row examples name their `sides` (KTO: an answer and the row that
    estimates its KL term) and the `per_example` values to pass on as tensors (KTO: `label`). Pairs with pictures
    give both rows their pixel values, from `pictures` (the model's processor)."""

    def __init__(
        self, pad_token_id: int, sides: tuple[str, str] = ("chosen", "rejected"), per_example=(), pictures=None
    ):
        self.pad_token_id, self.sides, self.per_example = pad_token_id, sides, tuple(per_example)
        self.pictures = pictures

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [
            {
                "input_ids": pair[f"{side}_input_ids"],
                "targets": pair[f"{side}_targets"],
                "position_ids": list(range(len(pair[f"{side}_input_ids"]))),
                "images": pair.get("images") or [],
            }
            for side in self.sides
            for pair in pairs
        ]
        batch = collate_rows(rows, self.pad_token_id, self.pictures)
        batch["pair_index"] = torch.tensor([pair["index"] for pair in pairs], dtype=torch.long)
        batch["pair_key"] = torch.tensor([pair["key"] for pair in pairs], dtype=torch.long)
        for name in self.per_example:
            batch[name] = torch.tensor([pair[name] for pair in pairs])
        return batch
