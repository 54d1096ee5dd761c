"""Rows and batches, shared by every token-level recipe: a tokenised example is `input_ids` plus `loss_mask` (1 where
the token is a training target); rows hold one example, or several when packing.

A row carries `position_ids` that restart at 0 for every example and NO attention mask. transformers then builds a
block-diagonal causal mask, so packed examples never attend to each other (sdpa, eager, flex; flash-attention uses the
same positions for its varlen kernel). Targets are shifted within each example, so no example is ever asked to predict
the first token of the next.
"""

from __future__ import annotations

import bisect
import random

import torch
from datasets import Dataset

from fsdp_recipes.common.errors import DataError

IGNORE_INDEX = -100  # targets that carry no loss (prompt tokens, padding, the last token of each example)


def shifted_targets(input_ids: list[int], loss_mask: list[int]) -> list[int]:
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
    """Training rows: `input_ids`, `targets` (shifted, IGNORE_INDEX where no loss) and `position_ids`; examples with
    pictures (data.images) keep them (`images`, a row's in its examples' order)."""
    input_ids, loss_masks = tokenized["input_ids"], tokenized["loss_mask"]
    pictures = tokenized["images"] if "images" in tokenized.column_names else None
    groups = (
        pack_lengths([len(ids) for ids in input_ids], max_length) if packing else [[i] for i in range(len(input_ids))]
    )
    rows: dict[str, list[list[int]]] = {"input_ids": [], "targets": [], "position_ids": []}
    if pictures is not None:
        rows["images"] = [[picture for index in group for picture in pictures[index]] for group in groups]
    for group in groups:
        row_ids, row_targets, row_positions = [], [], []
        for index in group:
            row_ids += input_ids[index]
            row_targets += shifted_targets(input_ids[index], loss_masks[index])
            row_positions += list(range(len(input_ids[index])))
        rows["input_ids"].append(row_ids)
        rows["targets"].append(row_targets)
        rows["position_ids"].append(row_positions)
    return Dataset.from_dict(rows)


def collate_rows(rows: list[dict[str, list[int]]], pad_token_id: int, pictures=None) -> dict[str, torch.Tensor]:
    """Right-pads rows to the longest. Padding gets its own positions (restarting at 0), so it forms a separate
    sequence that no real token attends to, and IGNORE_INDEX targets. Rows with pictures get their pixel values
    from `pictures` (data.images.ImageInputs, the model's processor); a batch of a vision-language model without any
    picture gets a blank one in a sequence of its own (`ImageInputs.with_blank_picture`), so that its vision tower runs
    at every forward on every rank, as FSDP's collectives need, without changing any loss or gradient."""
    real_tokens = [len(row["input_ids"]) for row in rows]
    if pictures is not None and not any(row.get("images") for row in rows):
        rows = [*rows[:-1], pictures.with_blank_picture(rows[-1])]
    width = max(len(row["input_ids"]) for row in rows)
    input_ids, targets, positions = [], [], []
    for row in rows:
        pad = width - len(row["input_ids"])
        input_ids.append(list(row["input_ids"]) + [pad_token_id] * pad)
        targets.append(list(row["targets"]) + [IGNORE_INDEX] * pad)
        positions.append(list(row["position_ids"]) + list(range(pad)))
    batch = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "real_tokens": torch.tensor(real_tokens, dtype=torch.long),
    }
    if pictures is not None:
        batch.update(pictures.pixel_inputs(batch["input_ids"], [row.get("images") or [] for row in rows]))
    return batch


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

    def __init__(self, pad_token_id: int, pictures=None):
        self.pad_token_id, self.pictures = pad_token_id, pictures

    def __call__(self, rows):
        return collate_rows(rows, self.pad_token_id, self.pictures)


def check_one_step_of_data(count: int, *, per_step: int, unit: str, batch: str, allowed: bool) -> None:
    """DataError when `count` rows (or pairs, ...) are fewer than one optimizer step takes (`per_step`, as `batch`
    spells it out): every step would repeat some, silently. `allowed` (repeat_small_dataset): no error."""
    if count >= per_step or allowed:
        return
    raise DataError(
        f"the training data has {count} {unit}, fewer than one optimizer step takes: {per_step} ({batch}), so every "
        f"step would repeat {unit}. Use more data or a smaller batch, or set repeat_small_dataset: true to train on "
        "repeated copies (noted in the run summary)"
    )


def train_dataloader(
    rows: Dataset, config, *, num_processes: int, pad_token_id: int, collate_fn=None, unit: str = "rows", pictures=None
) -> torch.utils.data.DataLoader:
    """Batches of `config.per_device_train_batch_size` rows, ordered by `config.train_sampling_strategy`: grouped by
    length (less padding) or shuffled (accelerate then makes the order depend only on seed and epoch). Pass it to
    `accelerator.prepare`, which splits it across ranks. `collate_fn`: for rows of another kind than token rows
    (e.g. classification rows or preference pairs); it must be picklable when dataloader_num_workers > 0. Rows are
    grouped by their `length` column if they have one, else by the length of `input_ids`. Fewer rows than one optimizer
    step takes are refused unless `config.repeat_small_dataset` (`unit`: what a row is, for the message). `pictures`:
    the model's processor (data.images.ImageInputs), for rows with images."""
    check_one_step_of_data(
        len(rows),
        per_step=config.per_device_train_batch_size * num_processes * config.gradient_accumulation_steps,
        unit=unit,
        allowed=config.repeat_small_dataset,
        batch=f"per_device_train_batch_size {config.per_device_train_batch_size} x {num_processes} processes x "
        f"gradient_accumulation_steps {config.gradient_accumulation_steps}",
    )
    sampler = None
    if config.train_sampling_strategy == "group_by_length":
        lengths = rows["length"] if "length" in rows.column_names else [len(ids) for ids in rows["input_ids"]]
        sampler = LengthGroupedSampler(
            lengths, seed=config.seed, group_size=config.per_device_train_batch_size * num_processes
        )
    return torch.utils.data.DataLoader(
        rows,
        batch_size=config.per_device_train_batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        collate_fn=collate_fn or RowCollator(pad_token_id, pictures),
        drop_last=False,
        num_workers=config.dataloader_num_workers,
    )
