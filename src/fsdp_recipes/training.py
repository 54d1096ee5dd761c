"""Pieces of a training loop that are easy to get subtly wrong under data parallelism: loss normalisation across
ranks and accumulation steps, the step count, evaluation that every rank runs in lockstep."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_scheduler

from .data.rows import collate_rows
from .losses import IGNORE_INDEX, causal_lm_loss_sum, count_targets


def build_optimizer(
    model: torch.nn.Module, *, learning_rate: float, weight_decay: float, betas, eps: float, fused: bool = False
):
    """AdamW; weight decay on matrices only (not on norms and biases). Build it on the unprepared model and pass
    both to `accelerator.prepare` together: FSDP2 then points it at the sharded parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kernels = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, **kernels)


def total_optimizer_steps(batches_per_epoch: int, gradient_accumulation_steps: int, *, max_steps: int, epochs: float) -> int:
    if max_steps > 0:
        return max_steps
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / gradient_accumulation_steps))  # no batch left out
    return max(1, math.ceil(epochs * steps_per_epoch))


def build_scheduler(optimizer, name: str, *, total_steps: int, warmup_steps: int, warmup_ratio: float):
    warmup = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


class BatchStream:
    """Batches forever, epoch after epoch (re-shuffled by epoch with the seedable sampler), knowing its position so a
    checkpoint can record it and a resumed run can start from it without loading the skipped batches."""

    def __init__(self, accelerator: Accelerator, dataloader: DataLoader, *, epoch: int = 0, batches_into_epoch: int = 0):
        self.accelerator = accelerator
        self.dataloader = dataloader
        self.epoch = epoch
        self.batches_into_epoch = batches_into_epoch
        self._iterator: Iterator | None = None

    def next(self) -> dict[str, torch.Tensor]:
        while True:
            if self._iterator is None:
                self._iterator = iter(self._loader_for_current_position())
            batch = next(self._iterator, None)
            if batch is not None:
                self.batches_into_epoch += 1
                return batch
            self.epoch, self.batches_into_epoch, self._iterator = self.epoch + 1, 0, None

    def _loader_for_current_position(self):
        self.dataloader.set_epoch(self.epoch)
        if not self.batches_into_epoch:
            return self.dataloader
        loader = self.accelerator.skip_first_batches(self.dataloader, self.batches_into_epoch)
        loader.set_epoch(self.epoch)  # a new loader starts at epoch 0 unless told
        return loader


@torch.no_grad()
def evaluate_loss(accelerator: Accelerator, model: torch.nn.Module, rows, *, batch_size: int, pad_token_id: int) -> float:
    """Mean per-token loss over all held-out rows, each counted once. Every rank runs the same number of forward
    passes (FSDP needs all ranks in every all-gather); a rank out of rows runs a masked copy of a row."""
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(rows), world))
    batches = math.ceil(math.ceil(len(rows) / world) / batch_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for index in range(batches):
        chosen = mine[index * batch_size : (index + 1) * batch_size]
        batch = collate_rows([rows[i] for i in (chosen or [0])], pad_token_id)
        if not chosen:
            batch["targets"].fill_(IGNORE_INDEX)
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        loss_sum += causal_lm_loss_sum(model, batch).double()
        count += count_targets(batch)
    if world > 1:
        loss_sum, count = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(count, "sum")
    model.train()
    return float(loss_sum / count.clamp(min=1))


@torch.no_grad()
def exact_match_accuracy(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer,
    examples: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int,
) -> dict[str, Any]:
    """Share of held-out examples whose greedy completion equals the reference exactly (after stripping spaces).

    Examples are `{"prompt_ids": [...], "reference": str}`. Ranks split the examples and generate in lockstep
    (`synced_gpus`), since under FSDP every forward pass is a collective."""
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(examples), world))
    batches = math.ceil(math.ceil(len(examples) / world) / batch_size)
    correct = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    samples = []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for index in range(batches):
            chosen = mine[index * batch_size : (index + 1) * batch_size]
            batch_examples = [examples[i] for i in (chosen or [0])]
            inputs = tokenizer.pad({"input_ids": [e["prompt_ids"] for e in batch_examples]}, return_tensors="pt")
            inputs = {key: value.to(accelerator.device) for key, value in inputs.items()}
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=world > 1,
            )
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            if not chosen:
                continue
            for example, text in zip(batch_examples, texts):
                hit = text.strip() == example["reference"].strip()
                correct += hit
                if len(samples) < 3:
                    samples.append({"reference": example["reference"], "generated": text.strip(), "correct": hit})
    finally:
        tokenizer.padding_side = padding_side
        model.train()
    if world > 1:
        correct = accelerator.reduce(correct, "sum")
    return {"exact_match": float(correct) / max(len(examples), 1), "num_examples": len(examples), "samples": samples}
