"""Chat-style SFT data: the two formats TRL's SFT accepts, recognised by their columns, tokenised with loss masks.

- conversational: `messages`, a list of {"role", "content"} turns, formatted with the tokenizer's chat template;
- prompt/completion: `prompt` and `completion`, each a string or a list of turns.

Every example becomes `input_ids` plus `loss_mask` (1 where the token is a training target), ready for
`fsdp_recipes.data.rows`.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from ..errors import DataError


def detect_format(column_names: list[str]) -> str:
    if "messages" in column_names:
        return "conversational"
    if "prompt" in column_names and "completion" in column_names:
        return "prompt_completion"
    raise DataError(
        f"the dataset has columns {sorted(column_names)}, but SFT needs either a 'messages' column (a list of "
        "{'role', 'content'} turns) or 'prompt' and 'completion' columns. Rename the columns (e.g. "
        "dataset.rename_column) or convert the data to one of these formats."
    )


def _conversation_tokens(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], loss_roles: set[str] | None, first_trained: int
) -> tuple[list[int], list[int]]:
    """Tokens of a whole conversation and a mask over those of messages at index >= first_trained whose role is in
    loss_roles (every token if loss_roles is None).

    A message's tokens are found by rendering growing prefixes of the conversation: the template applied to
    messages[:i] (plus the generation prompt when message i is the assistant's) must be a prefix of the template
    applied to messages[:i+1]. Most chat templates satisfy this; one that does not is reported, not guessed at."""
    full = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    if loss_roles is None:
        return full, [1] * len(full)
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = tokenizer.apply_chat_template(messages[:index], tokenize=True, add_generation_prompt=True)["input_ids"]
        upto = tokenizer.apply_chat_template(messages[: index + 1], tokenize=True)["input_ids"]
        if full[: len(head)] != head or full[: len(upto)] != upto:
            raise DataError(
                "the chat template renders a conversation differently from its prefixes, so the tokens of each "
                "assistant turn cannot be located for the loss mask. Use a template that only appends text turn "
                "by turn (set chat_template), or set assistant_only_loss: false to train on every token."
            )
        for position in range(len(head), len(upto)):
            mask[position] = 1
    return full, mask


def tokenize_example(
    example: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    data_format: str,
    *,
    assistant_only_loss: bool,
    completion_only_loss: bool,
    max_length: int,
) -> dict[str, Any]:
    if data_format == "conversational":
        loss_roles = {"assistant"} if assistant_only_loss else None
        ids, mask = _conversation_tokens(tokenizer, example["messages"], loss_roles, first_trained=0)
    elif isinstance(example["prompt"], list):  # conversational prompt/completion
        messages = list(example["prompt"]) + list(example["completion"])
        loss_roles = {"assistant"} if completion_only_loss else None
        ids, mask = _conversation_tokens(tokenizer, messages, loss_roles, first_trained=len(example["prompt"]))
    else:
        prompt = tokenizer(example["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion = completion + [tokenizer.eos_token_id]
        ids = prompt + completion
        mask = ([0] * len(prompt) if completion_only_loss else [1] * len(prompt)) + [1] * len(completion)
    truncated = len(ids) > max_length
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "truncated": truncated}


def tokenize_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    assistant_only_loss: bool,
    completion_only_loss: bool,
    max_length: int,
    num_proc: int | None = None,
    name: str = "train",
) -> tuple[Dataset, dict[str, int]]:
    """Tokenised examples that carry at least one loss token, and counts of what was truncated or dropped."""
    if len(dataset) == 0:
        raise DataError(f"the {name} split is empty: there is nothing to train or evaluate on")
    data_format = detect_format(dataset.column_names)
    uses_chat_template = data_format == "conversational" or isinstance(dataset[0]["prompt"], list)
    if uses_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so conversations cannot be formatted. Set "
            "chat_template in the recipe config to a Jinja template (a path to a .jinja file or the text itself), "
            "or use a tokenizer that ships one."
        )
    tokenized = dataset.map(
        tokenize_example,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            data_format=data_format,
            assistant_only_loss=assistant_only_loss,
            completion_only_loss=completion_only_loss,
            max_length=max_length,
        ),
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {name}",
    )
    with_loss = tokenized.filter(lambda mask: sum(mask[1:]) > 0, input_columns="loss_mask", num_proc=num_proc)
    stats = {
        "examples": len(dataset),
        "truncated": int(sum(tokenized["truncated"])),
        "dropped_without_loss_tokens": len(tokenized) - len(with_loss),
    }
    if len(with_loss) == 0:
        raise DataError(
            f"no {name} example has a token to learn from (all {len(dataset)} have an empty assistant/completion part "
            f"after truncation to max_length={max_length}). Raise max_length or check the data."
        )
    return with_loss.remove_columns("truncated"), stats


def generation_examples(dataset, tokenizer, limit: int) -> list[dict[str, Any]]:
    """Prompts (everything before the last assistant turn, or the prompt) and references from held-out raw data."""
    examples = []
    for record in dataset.select(range(min(limit, len(dataset)))):
        if "messages" in record:
            messages = record["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt_ids = tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True)["input_ids"]
            reference = messages[last]["content"]
        elif isinstance(record["prompt"], list):
            prompt_ids = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True)["input_ids"]
            reference = record["completion"][-1]["content"]
        else:
            prompt_ids = tokenizer(record["prompt"])["input_ids"]
            reference = record["completion"]
        examples.append({"prompt_ids": prompt_ids, "reference": reference})
    return examples
