"""Prompts for online RL, as TRL reads them: a `prompt` column holding text or chat turns (a list of
{"role", "content"}); every other column is kept by name for the reward functions (e.g. `answer`)."""

from __future__ import annotations

import dataclasses
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
) -> Prompts:
    """The prompts of `dataset` (a datasets.Dataset), tokenised; longer ones than `max_prompt_length` keep their end
    (counted in `truncated`). DataError when there is no prompt `column`, the data is empty, or a prompt is neither
    text nor chat turns."""
    names = list(dataset.column_names)
    images.refuse_images(names, "online RL (GRPO)")
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
    prompt_ids, truncated, reset_texts = [], 0, []
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
        if len(ids) > max_prompt_length:
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        prompt_ids.append(ids)
    columns = {name: list(dataset[name]) for name in names if name != column}
    return Prompts(prompts, prompt_ids, columns, truncated, reset_texts if reset is not None else None)
