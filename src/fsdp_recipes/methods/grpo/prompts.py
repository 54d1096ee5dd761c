"""Prompts for online RL, as TRL reads them: a `prompt` column holding text or chat turns (a list of
{"role", "content"}); every other column is kept by name for the reward functions (e.g. `answer`). With a
vision-language model, an `images` (or `image`) column gives the pictures of the prompts' image parts: the prompt's
placeholders become each picture's tokens, and the reward functions receive the pictures as PIL images."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import images
from fsdp_recipes.data.chat_masks import prepared_turns


@dataclasses.dataclass
class Prompts:
    prompts: list[Any]  # as the data holds them (text or chat turns), given to reward functions
    prompt_ids: list[list[int]]  # tokenised (chat turns through the chat template, ready for the assistant's turn)
    columns: dict[str, list[Any]]  # the other columns, by name
    truncated: int  # prompts longer than the room left for them, which kept their end
    reset_texts: list[str | None] | None = None  # an environment's reset() text, appended to each prompt's last turn
    images: list[list[bytes]] | None = None  # each prompt's pictures (file bytes), with a vision-language model

    def row(self, index: int) -> dict[str, Any]:
        """The data row of prompt `index`: its prompt and every other column, by name."""
        return {"prompt": self.prompts[index], **{name: values[index] for name, values in self.columns.items()}}

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def conversational(self) -> bool:
        return bool(self.prompts) and isinstance(self.prompts[0], list)


def tokenize_prompt(prompt: Any, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """A prompt's tokens: chat turns through the chat template (with the tools' schemas, which it shows the model)."""
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(
            prepared_turns(prompt), tools=tools or None, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(str(prompt))["input_ids"]


def load_prompts(
    dataset,
    tokenizer,
    *,
    max_prompt_length: int,
    split: str,
    column: str = "prompt",
    tools: list[dict] | None = None,
    reset=None,
    pictures: images.ImageInputs | None = None,
    image_roots: tuple = (),
) -> Prompts:
    """The prompts of `dataset` (a datasets.Dataset), tokenised; longer ones than `max_prompt_length` keep their end
    (counted in `truncated`). DataError when there is no prompt `column`, the data is empty, or a prompt is neither
    text nor chat turns. `pictures`: a vision-language model's processor, for data with an images column (paths
    looked up in `image_roots`, then the working directory); a prompt is never cut through a picture."""
    names = list(dataset.column_names)
    image_column = images.image_column(names)
    images.require_reader(image_column, pictures, split)
    if column not in names:
        raise DataError(
            f"the {split} split has no {column!r} column (it has: {', '.join(names)}): online RL reads prompts as "
            f"text or chat turns from {column!r} (dataset_prompt_column), and passes the other columns (e.g. "
            "'answer') to the reward functions"
        )
    if len(dataset) == 0:
        raise DataError(f"the {split} split has no rows")
    prompts = list(dataset[column])
    if tokenizer.chat_template is None and any(isinstance(p, list) for p in prompts):
        raise DataError(
            "the prompts are chat turns but the tokenizer has no chat template: set chat_template, or give text prompts"
        )
    prompt_ids, truncated, reset_texts, shown = [], 0, [], []
    given = list(dataset[image_column]) if image_column else None
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise DataError(f"prompt {index} of the {split} split is {type(prompt).__name__}: text or chat turns")
        if tools and not isinstance(prompt, list):
            raise DataError(
                f"prompt {index} of the {split} split is text: with tools the prompts must be chat turns, which the "
                "chat template renders with the tools' descriptions"
            )
        if reset is not None:  # an environment: its reset() text joins the last turn, as TRL appends it
            row = {"prompt": prompt, **{name: dataset[index][name] for name in names if name != column}}
            text = reset(row, f"prompt {index} of the {split} split")
            reset_texts.append(text)
            if text:
                prompt = [*prompt[:-1], {**prompt[-1], "content": str(prompt[-1]["content"]) + str(text)}]
        ids = tokenize_prompt(prompt, tokenizer, tools)
        if not ids:
            raise DataError(f"prompt {index} of the {split} split is empty once tokenised")
        if given is not None:
            ids = _with_pictures(
                ids,
                prompt,
                given[index],
                image_column,
                pictures,
                image_roots,
                shown,
                f"prompt {index} of the {split} split",
            )
            first = pictures.first_image_token(ids)
            if first is not None and first < len(ids) - max_prompt_length:
                raise DataError(
                    f"prompt {index} of the {split} split takes {len(ids)} tokens with its pictures, more than the "
                    f"{max_prompt_length} left for prompts (max_length - max_completion_length), and cutting it would "
                    "cut a picture: raise max_length, or shrink the images' resolution in the processor"
                )
        if len(ids) > max_prompt_length:
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        prompt_ids.append(ids)
    columns = {name: list(dataset[name]) for name in names if name != column}
    if image_column is not None:  # the reward functions' view: PIL images, whatever the data holds
        columns[image_column] = OpenedPictures(shown, single=image_column == "image")
    return Prompts(
        prompts, prompt_ids, columns, truncated, reset_texts if reset is not None else None, shown if given else None
    )


class OpenedPictures(Sequence):
    """A column of each prompt's pictures as PIL images (one per prompt for `image`), opened when read: the file
    bytes stay the only copy (thousands of decoded pictures would not fit in memory)."""

    def __init__(self, shown: list[list[bytes]], *, single: bool):
        self.shown, self.single = shown, single

    def __len__(self) -> int:
        return len(self.shown)

    def __getitem__(self, index: int):
        opened = [images.open_image(data) for data in self.shown[index]]
        return (opened[0] if opened else None) if self.single else opened


def _with_pictures(ids, prompt, given, column: str, pictures, roots, shown: list, where: str) -> list[int]:
    """The prompt's tokens with each image placeholder replaced by its picture's tokens; its pictures' bytes are
    added to `shown`."""
    pictures_given = images.images_of({column: given}, column)
    parts = images.image_parts(prompt) if isinstance(prompt, list) else 0
    if parts != len(pictures_given):
        raise DataError(
            f"{where} has {parts} image part(s) but {len(pictures_given)} image(s) in {column!r}"
            + ("" if isinstance(prompt, list) else ": pictures need chat turns with {'type': 'image'} parts")
        )
    try:
        data = [images.image_bytes(value, roots) for value in pictures_given]
        expanded, _ = pictures.expand(ids, [0] * len(ids), [images.open_image(one) for one in data])
    except ValueError as error:
        raise DataError(f"{where}: {error}. Fix or remove that row.") from None
    shown.append(data)
    return expanded
