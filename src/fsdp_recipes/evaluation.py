"""Evaluation that every rank runs in lockstep (under FSDP each forward pass is a collective): held-out loss with the
recipe's own loss function, and greedy-generation exact match. `LossEvaluator` also decides when to evaluate."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from .data.rows import collate_rows
from .losses import IGNORE_INDEX, count_targets
from .metrics import MetricsLog

LossSum = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


class LossEvaluator:
    """Held-out loss every `every` optimizer steps (None: only at the end) and at the last step, logged as
    `eval_loss`. Time spent here is left out of the throughput figures (`pause`)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, rows, *, loss_sum: LossSum, batch_size: int,
                 pad_token_id: int, every: int | None, total_steps: int, log: MetricsLog,
                 pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.accelerator, self.model, self.rows = accelerator, model, rows
        self.loss_sum, self.batch_size, self.pad_token_id = loss_sum, batch_size, pad_token_id
        self.every, self.total_steps, self.log, self.pause = every, total_steps, log, pause
        self.last_step: int | None = None

    def maybe_evaluate(self, step: int) -> float | None:
        due = step == self.total_steps or (self.every is not None and step % self.every == 0)
        return self.evaluate(step) if due and step != self.last_step else None

    def evaluate(self, step: int) -> float | None:
        if self.rows is None:
            return None
        with self.pause():
            loss = evaluate_loss(self.accelerator, self.model, self.rows, loss_sum=self.loss_sum,
                                 batch_size=self.batch_size, pad_token_id=self.pad_token_id)
        self.log.log({"step": step, "eval_loss": loss})
        self.last_step = step
        return loss


@torch.no_grad()
def evaluate_loss(
    accelerator: Accelerator, model: torch.nn.Module, rows, *, loss_sum: LossSum, batch_size: int, pad_token_id: int
) -> float:
    """Mean per-token loss over all held-out rows, each counted once, with the recipe's `loss_sum(model, batch)`.
    Every rank runs the same number of forward passes (FSDP needs all ranks in every all-gather); a rank out of rows
    runs a masked copy of a row."""
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(rows), world))
    batches = math.ceil(math.ceil(len(rows) / world) / batch_size)
    total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for index in range(batches):
        chosen = mine[index * batch_size : (index + 1) * batch_size]
        batch = collate_rows([rows[i] for i in (chosen or [0])], pad_token_id)
        if not chosen:
            batch["targets"].fill_(IGNORE_INDEX)
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        total += loss_sum(model, batch).double()
        count += count_targets(batch)
    if world > 1:
        total, count = accelerator.reduce(total, "sum"), accelerator.reduce(count, "sum")
    model.train()
    return float(total / count.clamp(min=1))


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
