"""Checkpoints under real 2-process FSDP2 launches: a rank killed while saving stops the job and leaves the previous
checkpoint as `latest`; the run resumes from it exactly, on the same or another world size."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.sft import STEPS, run_sft
from fsdp_recipes.train.checkpoint import complete_checkpoints, latest_checkpoint
from helpers.launch import concurrently
from helpers.recipes import read_metrics

pytestmark = pytest.mark.slow
RESUMED_FROM = 3


def losses_by_step(output_dir: Path) -> dict[int, float]:
    """The last loss logged for each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


def copy_of(killed_during_save, tmp_path: Path) -> tuple[Path, dict]:
    source, values, _, _ = killed_during_save
    out = tmp_path / "out"
    shutil.copytree(source, out)
    return out, {**values, "output_dir": str(out)}


def test_a_rank_killed_while_saving_stops_the_job_and_leaves_the_previous_checkpoint(killed_during_save):
    out, _, result, finished = killed_during_save
    assert result.returncode != 0
    killed_at = float(re.search(r"FAULT: SIGKILL to rank 1 at ([0-9.]+)", result.stderr).group(1))
    assert finished - killed_at < 30, f"the launcher took {finished - killed_at:.1f} s to stop after the kill"
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", result.stderr)  # the launcher names the failed rank
    assert latest_checkpoint(out).name == "step-00000003"
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000003"]
    assert list((out / "checkpoints").glob(".staging-*"))  # the half-written save is there, and ignored
    assert not (out / "model.safetensors").exists()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, killed_during_save) -> dict[int, Path]:
    """The killed run resumed from its latest checkpoint on 2 processes, and on 1 (another world size, the same global
    batch: DCP reshards; 2 -> 4 takes the same path, and the HSDP run of tests/test_topology_rehearsal.py checks 4
    ranks' state bytes), launched side by side. {processes: output_dir}."""

    def resume(num_processes: int) -> Path:
        tmp = tmp_path_factory.mktemp(f"resumed_on_{num_processes}")
        out, values = copy_of(killed_during_save, tmp)
        overrides = {} if num_processes == 2 else {"per_device_train_batch_size": 8, "exact_match_eval_samples": 0}
        run_sft(
            tmp, "resumed", {**values, "resume_from_checkpoint": "latest", **overrides}, num_processes=num_processes
        )
        return out

    return dict(zip((2, 1), concurrently(lambda: resume(2), lambda: resume(1))))


def test_killed_run_resumes_with_identical_losses_and_bitwise_equal_weights(reference_run, resumed):
    out = resumed[2]
    resumed_losses, reference_losses = losses_by_step(out), losses_by_step(reference_run)
    assert sorted(resumed_losses) == list(range(1, STEPS + 1))
    assert resumed_losses == reference_losses  # exactly equal, step for step
    resumed_weights, reference_weights = (
        load_file(out / "model.safetensors"),
        load_file(reference_run / "model.safetensors"),
    )
    assert resumed_weights.keys() == reference_weights.keys()
    for key in reference_weights:
        assert torch.equal(resumed_weights[key], reference_weights[key]), key
    assert [e["step"] for e in read_metrics(out) if e.get("event") == "resumed"] == [RESUMED_FROM]
    assert not list((out / "checkpoints").glob(".staging-*"))
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000009", "step-00000012"]  # save_total_limit 2
    # The exact match before training was measured by the interrupted run; the resumed one reads it from the log.
    reference_results = json.loads((reference_run / "eval_results.json").read_text())
    assert json.loads((out / "eval_results.json").read_text()) == reference_results


def test_resume_on_another_world_size(reference_run, resumed):
    out, num_processes = resumed[1], 1
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == num_processes and summary["distributed_type"] == "FSDP"
    assert summary["state_bytes_per_rank"] == summary["memory_estimate"]["rank_state_bytes_per_rank"]
    resumed_losses, expected = losses_by_step(out), losses_by_step(reference_run)
    steps = list(range(RESUMED_FROM + 1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([resumed_losses[s] for s in steps]),
        torch.tensor([expected[s] for s in steps]),
        rtol=1e-5,
        atol=1e-6,
    )
