"""Throughput windows and final figures, in-process: evaluation and checkpoint time is not training time, and the
warm-up window is left out of the final means."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train.metrics import MetricsLog, StepLogger, ThroughputWindow


def batch(rows: int, width: int, real: int) -> dict:
    return {"input_ids": torch.zeros(rows, width, dtype=torch.long), "real_tokens": torch.full((rows,), real)}


def test_paused_time_is_not_counted_as_training_time():
    window = ThroughputWindow()
    with window.paused():  # an evaluation or a checkpoint save
        time.sleep(0.3)
    assert window.elapsed < 0.1
    assert window.paused_for >= 0.3


def test_first_window_is_warmup_and_left_out_of_the_final_means(tmp_path, monkeypatch):
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    log = MetricsLog(tmp_path, enabled=True, printer=lambda text: None)
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=1, hidden_size=4)
    logger = StepLogger(
        accelerator,
        log,
        parallel=ParallelDims(),  # one process
        every=1,
        total_steps=3,
        model_config=config,
        non_embedding_parameters=10,
        peak_flops=None,
        position=lambda: {"lr": 1e-3},
    )
    elapsed = iter([10.0, 1.0, 1.0])  # the warm-up window is slow: compilation, cold caches
    monkeypatch.setattr(ThroughputWindow, "elapsed", property(lambda self: next(elapsed)))
    for step in (1, 2, 3):
        logger.window.add_batch(batch(rows=2, width=8, real=8))
        logger.log_step(step, loss_sum=2.0, target_count=4)
    records = [r for r in log.records if "loss" in r]
    assert [r.get("warmup", False) for r in records] == [True, False, False]
    assert [r["tokens_per_second"] for r in records] == [1.6, 16.0, 16.0]
    assert logger.final_metrics()["tokens_per_second"] == pytest.approx(16.0)  # not (1.6 + 16 + 16) / 3
    assert records[0]["loss"] == pytest.approx(0.5) and records[0]["lr"] == 1e-3


def test_a_lone_warmup_window_is_still_reported(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, printer=lambda text: None)
    log.log({"step": 1, "tokens_per_second": 5.0, "warmup": True})
    assert log.mean("tokens_per_second") == 5.0
