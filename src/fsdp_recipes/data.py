"""SFT data: loading (Hub or local files), the two formats, tokenisation with loss masks, packing, and batches.

Two formats are recognised by their columns:
- conversational: `messages`, a list of {"role", "content"} turns, formatted with the tokenizer's chat template;
- prompt/completion: `prompt` and `completion`, each a string or a list of turns.

Every example becomes `input_ids` plus `loss_mask` (1 where the token is a training target). A training row holds one
example, or several when packing; it carries `position_ids` that restart at 0 for every example and NO attention
mask. transformers then builds a block-diagonal causal mask, so packed examples never attend to each other (sdpa,
eager, flex; flash-attention uses the same positions for its varlen kernel). Targets are shifted within each
example, so no example is ever asked to predict the first token of the next.
"""

from __future__ import annotations

import bisect
import random
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase

from .errors import DataError
from .losses import IGNORE_INDEX

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(dataset_name: str, dataset_config: str | None = None) -> DatasetDict:
    """A Hub dataset id, a local data file, or a local folder of data files (all splits it has)."""
    path = Path(dataset_name)
    if path.is_file():
        builder = _LOCAL_FORMATS.get(path.suffix)
        if builder is None:
            raise DataError(f"{dataset_name}: unsupported file type {path.suffix!r}; use one of {sorted(_LOCAL_FORMATS)}")
        if path.stat().st_size == 0:
            raise DataError(f"{dataset_name} is empty: there is nothing to train on. Point dataset_name at the data.")
        return load_dataset(builder, data_files={"train": str(path)})
    return load_dataset(dataset_name, dataset_config)


def split_train_eval(
    raw: DatasetDict, train_split: str, test_split: str | None, eval_split_size: float, seed: int
) -> tuple[Dataset, Dataset | None]:
    if train_split not in raw:
        raise DataError(f"the dataset has no split {train_split!r} (it has {sorted(raw)}); set dataset_train_split")
    train = raw[train_split]
    if test_split and test_split in raw:
        return train, raw[test_split]
    if eval_split_size > 0 and len(train) > 1:
        parts = train.train_test_split(test_size=eval_split_size, seed=seed)
        return parts["train"], parts["test"]
    return train, None


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


def _shifted_targets(input_ids: list[int], loss_mask: list[int]) -> list[int]:
    """targets[i] is the token position i must predict (input_ids[i + 1]) or IGNORE_INDEX; the last position of an
    example predicts nothing, so packed neighbours never leak into each other's loss."""
    targets = [ids if keep else IGNORE_INDEX for ids, keep in zip(input_ids[1:], loss_mask[1:])]
    return targets + [IGNORE_INDEX]


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: groups of example indices whose lengths add up to at most `capacity`. Deterministic,
    so the rows do not depend on the number of processes."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free_space: list[tuple[int, int]] = []  # (space left, row index), kept sorted
    rows: list[list[int]] = []
    for index in order:
        need = lengths[index]
        slot = bisect.bisect_left(free_space, (need, -1))
        if slot == len(free_space):
            rows.append([index])
            bisect.insort(free_space, (capacity - need, len(rows) - 1))
        else:
            space, row = free_space.pop(slot)
            rows[row].append(index)
            bisect.insort(free_space, (space - need, row))
    return rows


def build_rows(tokenized: Dataset, *, max_length: int, packing: bool) -> Dataset:
    """Training rows: `input_ids`, `targets` (shifted, IGNORE_INDEX where no loss) and `position_ids`."""
    input_ids, loss_masks = tokenized["input_ids"], tokenized["loss_mask"]
    groups = pack_lengths([len(ids) for ids in input_ids], max_length) if packing else [[i] for i in range(len(input_ids))]
    rows: dict[str, list[list[int]]] = {"input_ids": [], "targets": [], "position_ids": []}
    for group in groups:
        row_ids, row_targets, row_positions = [], [], []
        for index in group:
            row_ids += input_ids[index]
            row_targets += _shifted_targets(input_ids[index], loss_masks[index])
            row_positions += list(range(len(input_ids[index])))
        rows["input_ids"].append(row_ids)
        rows["targets"].append(row_targets)
        rows["position_ids"].append(row_positions)
    return Dataset.from_dict(rows)


def collate_rows(rows: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pads rows to the longest. Padding gets its own positions (restarting at 0), so it forms a separate
    sequence that no real token attends to, and IGNORE_INDEX targets."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids, targets, positions = [], [], []
    for row in rows:
        pad = width - len(row["input_ids"])
        input_ids.append(list(row["input_ids"]) + [pad_token_id] * pad)
        targets.append(list(row["targets"]) + [IGNORE_INDEX] * pad)
        positions.append(list(row["position_ids"]) + list(range(pad)))
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "real_tokens": torch.tensor([len(row["input_ids"]) for row in rows], dtype=torch.long),
    }


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Row order for one epoch that puts rows of similar length in the same global batch, so little is padded, while
    the order of batches stays random: shuffle, cut into mega-chunks of `megabatch` global batches, sort each chunk
    by length, cut into global batches, shuffle those.

    `group_size` is the rows of one global micro-batch (per-device batch x processes): the order then depends only
    on seed, epoch and the global batch, not on how it is split into ranks, which keeps losses and resume positions
    the same on any number of processes."""

    def __init__(self, lengths: list[int], group_size: int, *, seed: int, megabatch: int = 50):
        self.lengths = list(lengths)
        self.group_size = group_size
        self.seed = seed
        self.megabatch = megabatch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        generator.shuffle(order)
        chunk_size = self.megabatch * self.group_size
        groups = []
        for start in range(0, len(order), chunk_size):
            chunk = sorted(order[start : start + chunk_size], key=lambda i: -self.lengths[i])
            groups += [chunk[i : i + self.group_size] for i in range(0, len(chunk), self.group_size)]
        generator.shuffle(groups)
        return iter([index for group in groups for index in group])


class RowCollator:
    """Picklable collate_fn for DataLoader workers."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows):
        return collate_rows(rows, self.pad_token_id)
