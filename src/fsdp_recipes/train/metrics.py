"""Run records: the metrics log (`metrics.jsonl`, one JSON object per logging step) and the run summary."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.common.tables import format_value
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models.experts import is_routed_expert_parameter
from fsdp_recipes.train.cadence import Cadence


class MetricsLog:
    """Appends records to `output_dir/metrics.jsonl` and prints them; a no-op on non-main processes."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, printer=print, tracker=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.printer = printer
        self.tracker = tracker
        self.records: list[dict[str, Any]] = []

    def start(self, *, resumed_step: int | None) -> None:
        """A new run starts a new log; a resumed run keeps the earlier records (and, in memory, those up to the step
        it resumes from, so curves and final figures cover the whole run)."""
        if not self.enabled:
            return
        if resumed_step is None:
            self.path.unlink(missing_ok=True)
            return
        if self.path.is_file():
            earlier = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.records = [r for r in earlier if r.get("step", 0) <= resumed_step and "event" not in r]

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {key: _plain(value) for key, value in record.items()}
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker(record)
        self.printer(" ".join(f"{key}={format_value(value)}" for key, value in record.items()))

    def mean(self, key: str) -> float | None:
        """Mean over the records that have `key`, leaving out warm-up windows (the first window of each process
        start: compilation, allocator growth, cold caches) unless there is nothing else."""
        records = [r for r in self.records if isinstance(r.get(key), (int, float))]
        steady = [r for r in records if not r.get("warmup")] or records
        return sum(r[key] for r in steady) / len(steady) if steady else None

    def first(self, key: str) -> Any:
        return next((record[key] for record in self.records if key in record), None)

    def last(self, key: str) -> Any:
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return None


def numeric_fields(record: dict[str, Any], *, keep_text: bool = False) -> dict[str, Any]:
    """What trackers accept: numbers (and, for hyperparameters, also strings and booleans)."""

    def accepted(value: Any) -> bool:
        if isinstance(value, bool) or isinstance(value, str):
            return keep_text
        return isinstance(value, (int, float))

    return {key: value for key, value in record.items() if accepted(value)}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# Dense bf16 peak FLOP/s per device, from the vendors' data sheets; matched against the device name.
# Anything else (and every CPU) reports achieved FLOP/s and no MFU unless `peak_flops_per_device` is set.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops_per_device(device_name: str, override: float | None = None) -> float | None:
    if override:
        return override
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def flops_per_token(config, *, non_embedding_parameters: int, sequence_length: float) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters (forward + backward matmuls) plus the attention
    scores and values, 12 x layers x heads x head_dim x sequence length (the PaLM / torchtitan accounting); a
    vision-language model's attention counted over its language model's layers."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6 * non_embedding_parameters + 12 * layers * heads * head_dim * sequence_length


def peak_memory_bytes(device) -> int:
    """GPU: the most memory PyTorch has had reserved; CPU: the process's peak resident set size."""
    import resource

    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_figure_notes(device_type: str) -> str:
    """What the final metrics' two memory figures count, said under them: they measure different things."""
    measured = (
        "PyTorch's peak reserved GPU memory"
        if device_type == "cuda"
        else "the process's peak resident memory (RSS: Python, torch, libraries and data included), not device memory"
    )
    return (
        "  estimated_memory_gib_per_gpu: predicted, not measured: weights, gradients, optimizer state, activations, "
        "logits and FSDP buffers one GPU holds (docs/memory-estimator.md)\n"
        f"  peak_memory_gib_max: measured on the busiest rank: {measured}"
    )


class ThroughputWindow:
    """Accumulates what happened between two logging steps on this rank."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.paused_for = 0.0  # evaluation and checkpoint saves: not training time
        self.steps = 0
        self.real_tokens = 0
        self.slots = 0
        self.data_wait = 0.0
        self.width_sum = 0.0
        self.batches = 0

    def add_batch(self, batch) -> None:
        rows, width = batch["input_ids"].shape
        self.real_tokens = self.real_tokens + batch["real_tokens"].sum()  # on the device until a logging step reads it
        self.slots += rows * width
        self.width_sum += width
        self.batches += 1

    @contextlib.contextmanager
    def paused(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_for += time.perf_counter() - started

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.paused_for

    @property
    def mean_width(self) -> float:
        return self.width_sum / max(self.batches, 1)


def plot_training_curves(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Train/eval loss and tokens/s against step, as a PNG, and beside them the lm-eval benchmarks' scores
    (`benchmark/<task>/<metric>`: those in [0, 1] on one panel, perplexities and the like on a log-scale one). A bare
    `Figure` with fixed margins: pyplot's machinery and an automatic layout would cost the end of every run ~2 s on a
    small CPU, for nothing a PNG needs."""
    from matplotlib.figure import Figure

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("benchmark/") and isinstance(value, (int, float)):
                series.setdefault(key.removeprefix("benchmark/"), []).append((record["step"], value))
    scores = {name: points for name, points in series.items() if all(0 <= v <= 1 for _, v in points)}
    others = {name: points for name, points in series.items() if name not in scores}
    panels = 2 + bool(scores) + bool(others)
    figure = Figure(figsize=(5.5 * panels, 4))
    figure.subplots_adjust(left=0.08 / panels * 2, right=0.98, bottom=0.13, top=0.95, wspace=0.22)
    loss_axis, speed_axis, *benchmark_axes = figure.subplots(1, panels)
    loss_axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        loss_axis.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    loss_axis.set_yscale("log")
    loss_axis.legend()
    speed_axis.plot([r["step"] for r in train], [r["tokens_per_second"] for r in train])
    speed_axis.set_xlabel("step")
    speed_axis.set_ylabel("real tokens / s (all ranks)")
    for axis, group, label in zip(benchmark_axes, [g for g in (scores, others) if g], ("score", "value (log)")):
        for name, points in group.items():
            axis.plot([step for step, _ in points], [value for _, value in points], "o-", label=name)
        axis.set_xlabel("step")
        axis.set_ylabel(f"lm-eval benchmark {label}")
        if group is others:
            axis.set_yscale("log")
        axis.legend(fontsize="small")
    figure.savefig(path, dpi=100)
    return Path(path)


def throughput_record(
    accelerator,
    window: ThroughputWindow,
    *,
    parallel: ParallelDims,
    model_config,
    non_embedding_parameters: int,
    peak_flops: float | None,
) -> dict[str, Any]:
    """Collective: speed, padding, FLOPs and memory over the window, for all ranks together (the tokens counted once
    per data-parallel rank of `parallel`, the run's layout)."""
    from fsdp_recipes.distributed.collectives import sum_over_ranks, values_of_all_ranks

    elapsed = window.elapsed
    real_tokens = sum_over_ranks(accelerator, window.real_tokens, parallel=parallel)
    slots = sum_over_ranks(accelerator, window.slots, parallel=parallel)
    tokens_per_second = real_tokens / elapsed
    per_device = tokens_per_second / accelerator.num_processes
    per_token = flops_per_token(
        model_config, non_embedding_parameters=non_embedding_parameters, sequence_length=window.mean_width
    )
    achieved = per_device * per_token
    memory = values_of_all_ranks(accelerator, peak_memory_bytes(accelerator.device))
    record = {
        "tokens_per_second": tokens_per_second,
        "tokens_per_second_per_device": per_device,
        "padding_fraction": 1.0 - real_tokens / max(slots, 1.0),
        "step_time_s": elapsed / max(window.steps, 1),
        "data_wait_fraction": window.data_wait / elapsed,
        "flops_per_token": per_token,
        "achieved_flops_per_device": achieved,
        "mfu": achieved / peak_flops if peak_flops else None,
        "peak_memory_gib_per_rank": [round(m / 2**30, 4) for m in memory],
    }
    if accelerator.device.type == "cuda":  # what tensors held, beside what the allocator kept: the estimator's measure
        allocated = values_of_all_ranks(accelerator, int(torch.cuda.max_memory_allocated(accelerator.device)))
        record["peak_allocated_gib_per_rank"] = [round(m / 2**30, 4) for m in allocated]
    return record


class StepLogger:
    """Decides when a training step is logged (every `every` steps and the last) and logs it: loss, learning rate,
    gradient norm and the throughput of the window since the last record. The first window of each process start is
    marked `warmup` and left out of the final means; evaluation and checkpoint time is left out of every window
    (`window.paused()`)."""

    def __init__(
        self,
        accelerator,
        log: MetricsLog,
        *,
        parallel: ParallelDims,
        every: int,
        total_steps: int,
        model_config,
        non_embedding_parameters: int,
        peak_flops: float | None,
        position: Callable[[], dict[str, Any]] = dict,
        step_figures: Callable[[], dict[str, Any]] = dict,
    ):
        """`parallel`: the run's layout, whose data-parallel ranks the sums are taken over. `position()`: what every
        record carries besides the step's figures (the run gives the epoch and the scheduler's learning rate).
        `step_figures()`: figures of the step that its loop does not pass (a mixture of experts' `aux_loss`, from the
        router balance the loop never sees)."""
        self.accelerator, self.parallel, self.log = accelerator, parallel, log
        self.cadence = Cadence(every, total_steps)
        self.position, self.step_figures = position, step_figures
        self.model_config, self.non_embedding_parameters, self.peak_flops = (
            model_config,
            non_embedding_parameters,
            peak_flops,
        )
        self.window = ThroughputWindow()
        self._first_window = True

    def log_step(
        self,
        step: int,
        *,
        loss_sum,
        target_count: float | None = None,
        grad_norm=None,
        sums: dict | Callable[[], dict] | None = None,
        extremes: dict | None = None,
        **fields,
    ) -> None:
        """Collective at logging steps (all ranks call it every step). `loss_sum` is this rank's summed loss over the
        step's `target_count` targets (or examples) of all ranks; each of `sums` is this rank's sum of a per-example
        figure, logged as its mean over the step's global batch. Without `target_count`, `loss_sum` and `sums` are
        this rank's shares of means already taken over the global batch (GRPO's token weights), summed over ranks.
        Values may be tensors on the device, and `sums` a function giving them: they are read here, at logging steps
        only, so that no step waits for the device to report a figure that is not logged. `extremes`: {name: ("max"
        or "min", this rank's value)}, logged as the largest or smallest over the ranks."""
        from fsdp_recipes.distributed.collectives import extreme_over_ranks, sum_over_ranks

        self.window.steps += 1
        if not self.cadence.due(step):
            return
        means, divisor = {}, 1.0 if target_count is None else max(float(target_count), 1.0)
        sums = sums() if callable(sums) else sums
        fields = {**self.step_figures(), **fields}
        fields = {name: float(value) if isinstance(value, torch.Tensor) else value for name, value in fields.items()}
        if sums:
            names = sorted(sums)
            totals = [sum_over_ranks(self.accelerator, sums[name], parallel=self.parallel) for name in names]  # cheap
            means = {name: total / divisor for name, total in zip(names, totals)}
        for name, (kind, value) in sorted((extremes or {}).items()):
            means[name] = float(extreme_over_ranks(self.accelerator, value, kind))
        record = {
            "step": step,
            **self.position(),
            **fields,
            **means,
            "loss": sum_over_ranks(self.accelerator, loss_sum, parallel=self.parallel) / divisor,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            **throughput_record(
                self.accelerator,
                self.window,
                parallel=self.parallel,
                model_config=self.model_config,
                non_embedding_parameters=self.non_embedding_parameters,
                peak_flops=self.peak_flops,
            ),
        }
        if self._first_window:
            record["warmup"] = True
            self._first_window = False
        self.log.log(record)
        self.window.reset()

    def count_batch(self, batch) -> None:
        """A batch the recipe made itself (not taken from the run's batch stream, which counts its own): its real
        tokens and slots join the window's throughput."""
        self.window.add_batch(batch)

    def due(self, step: int) -> bool:
        """Whether `step` is a logging step."""
        return self.cadence.due(step)

    def final_metrics(self) -> dict:
        """Means of the speed figures over the logged windows (warm-up left out), the peak memory, and apart from the
        steady state, the first step of the last launch (its compile pause included)."""
        keys = (
            "step_time_s",
            "tokens_per_second",
            "tokens_per_second_per_device",
            "padding_fraction",
            "data_wait_fraction",
            "mfu",
            "achieved_flops_per_device",
        )
        return {
            **{key: self.log.mean(key) for key in keys},
            "first_step_time_s": self.log.last("first_step_time_s"),
            "peak_memory_gib_max": max(self.log.last("peak_memory_gib_per_rank") or [0.0]),
        }


def held_state_bytes(model, optimizer, frozen: dict | None = None, *, split_experts: bool = False) -> dict[str, int]:
    """What this rank really holds, to set beside `state_bytes_on_rank`: the storage behind its parameter and gradient
    shards (FSDP2 allocates them padded; gradients may share one buffer) and its AdamW state tensors; and for each of
    `frozen` ({name: a frozen model, or None where the run holds none}) its parameter shards. Call it after an
    optimizer step, before the gradients are zeroed. `split_experts`: also the routed experts' share of the parameters
    (a mixture of experts trained whole; the estimator predicts the same split)."""

    def local(tensor):
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return getattr(tensor, "_tensor", tensor)  # torchao's float8 training weight wraps the stored tensor

    def storage_bytes(tensors) -> int:
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    states = [local(value) for state in inner.state.values() for value in state.values() if torch.is_tensor(value)]
    experts = [local(p) for name, p in model.named_parameters() if split_experts and is_routed_expert_parameter(name)]
    return {
        "parameters": storage_bytes(local(p) for p in model.parameters()),
        # a mixture of experts: the routed experts' share of this rank's parameters (their shards, unpadded)
        **({"routed_expert_parameters": sum(t.numel() * t.element_size() for t in experts)} if experts else {}),
        "gradients": storage_bytes(local(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer_state": sum(t.numel() * t.element_size() for t in states),
        **{
            name: storage_bytes(local(p) for p in copy.parameters()) if copy is not None else 0
            for name, copy in (frozen or {}).items()
        },
    }
