"""Pieces of a training loop that are easy to get subtly wrong under data parallelism: the optimizer and schedule,
the step count, a batch stream that knows its position for exact resume, and gradient accumulation that reduces
across ranks once per optimizer step."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_scheduler

from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train import expert_bias, router_balance, trainer_arguments


def build_optimizer(model: torch.nn.Module, config) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the config's `learning_rate`, `weight_decay`, `adam_*` and `optim`;
    weight decay on matrices only (not on norms and biases). Build it on the unprepared model and pass both to
    `accelerator.prepare` together: FSDP2 then points it at the sharded parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kernels = {"fused": True} if config.optim == "adamw_torch_fused" else {"foreach": True}
    return torch.optim.AdamW(
        groups,
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        **kernels,
    )


def total_optimizer_steps(batches_per_epoch: int, config) -> int:
    """The run's optimizer steps: the config's `max_steps` when > 0, else `num_train_epochs` over the batches of an
    epoch, `gradient_accumulation_steps` batches a step (a last partial step included)."""
    if config.max_steps > 0:
        return config.max_steps
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / config.gradient_accumulation_steps))  # no batch left out
    return max(1, math.ceil(config.num_train_epochs * steps_per_epoch))


def build_scheduler(optimizer, config, *, total_steps: int):
    """The config's `lr_scheduler_type` over `total_steps`, with its `lr_scheduler_kwargs`, warming up for
    `warmup_steps` (a count, or a fraction of the run) or `warmup_ratio`."""
    return get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=trainer_arguments.warmup_steps(config, total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=dict(config.lr_scheduler_kwargs or {}),
    )


def apply_settings_on_resume(scheduler, config) -> None:
    """After a checkpoint is loaded: the optimizer's hyperparameters and the schedule's peak as the config now says.
    The checkpoint's optimizer state carries its own (learning_rate, weight_decay, adam_*), which would otherwise win
    in silence over a value changed for the resumed run; the moments and the step count stay the checkpoint's."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the torch scheduler
    optimizer = inner.optimizer
    optimizer.param_groups[0]["weight_decay"] = config.weight_decay  # build_optimizer's first group: the matrices
    for group in optimizer.param_groups:
        group.update(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
        group["initial_lr"] = config.learning_rate
    inner.base_lrs = [config.learning_rate] * len(optimizer.param_groups)
    if hasattr(inner, "lr_lambdas"):  # every schedule get_scheduler builds for a step count is a LambdaLR
        for group, base, factor in zip(optimizer.param_groups, inner.base_lrs, inner.lr_lambdas):
            group["lr"] = base * factor(inner.last_epoch)
        inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def micro_batches_in_sync(
    accelerator: Accelerator, model: torch.nn.Module, micro_batches: list, *, parallel: ParallelDims
):
    """Yields the micro-batches of one optimizer step; gradients are reduced across ranks once, on the last one
    (the others run under `no_sync`). Collective: first, a mixture of experts' router balance, where the recipe
    attached one (`router_balance.attach`), takes its pass over all of them (the step's global expert shares, over
    the data-parallel ranks of `parallel`, the run's layout); a DeepSeek-style router's bias update
    (`expert_bias.attach`) is told each micro-batch, whose real tokens it counts."""
    balance = router_balance.attached(model)
    if balance is not None:
        balance.before_step(accelerator, model, micro_batches, parallel=parallel)
    bias = expert_bias.attached(model)  # the micro-batch a forward runs on: its real tokens are the loads counted
    try:
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            if bias is not None:
                bias.micro_batch = batch
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                yield batch
    finally:
        if bias is not None:
            bias.micro_batch = None


class BatchStream:
    """Batches forever, epoch after epoch (re-shuffled by epoch with the seedable sampler), knowing its position so a
    checkpoint can record it and a resumed run can start from it without loading the skipped batches."""

    def __init__(
        self, accelerator: Accelerator, dataloader: DataLoader, *, epoch: int = 0, batches_into_epoch: int = 0
    ):
        self.accelerator = accelerator
        self.dataloader = dataloader
        self.epoch = epoch
        self.batches_into_epoch = batches_into_epoch
        self._iterator: Iterator | None = None

    def take(self, count: int, window=None) -> list[dict[str, torch.Tensor]]:
        """The next `count` batches; `window` (a metrics.ThroughputWindow), if given, records them and the time spent
        waiting for them."""
        waiting = time.perf_counter()
        batches = [self.next() for _ in range(count)]
        if window is not None:
            window.data_wait += time.perf_counter() - waiting
            for batch in batches:
                window.add_batch(batch)
        return batches

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
