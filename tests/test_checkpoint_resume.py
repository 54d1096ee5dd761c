"""Checkpoints under real 2-process FSDP2 launches: a preemption signal that reaches one rank makes both save the same
step and stop; the same command started again resumes by itself, exactly, and a requeued job resumes on another world
size. (A rank killed while saving: tests/test_sft_lora.py.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.sft import STEPS, run_sft
from fsdp_recipes.train.checkpoint import complete_checkpoints
from helpers.launch import concurrently
from helpers.recipes import read_metrics

pytestmark = pytest.mark.slow
PREEMPTED_AT = 4


def losses_by_step(output_dir: Path) -> dict[int, float]:
    """The last loss logged for each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, preempted_run) -> dict:
    """Launched side by side, from copies of the preempted run: started again with its own command on its 2
    processes; and resumed on 1 process (another world size, the same global batch: DCP reshards; 2 -> 4 takes the
    same path, and the HSDP run of tests/test_topology_rehearsal.py checks 4 ranks' state bytes) as a requeued SLURM
    job starts, its preemption mark removed: by the restart count alone. {processes: output_dir}."""
    source, values, _ = preempted_run

    def copy(name: str) -> tuple[Path, Path]:
        tmp = tmp_path_factory.mktemp(name)
        shutil.copytree(source, tmp / "out")  # the preempted folder stays as it was left, for the test below
        return tmp, tmp / "out"

    def restart() -> Path:
        tmp, out = copy("restarted")
        run_sft(tmp, "restarted", {**values, "output_dir": str(out)})  # the same values: no resume flag
        return out

    def requeued_on_one_process() -> Path:
        tmp, out = copy("resumed_on_1")
        (out / "checkpoints" / "PREEMPTED").unlink()
        overrides = {"output_dir": str(out), "per_device_train_batch_size": 8, "exact_match_eval_samples": 0}
        run_sft(tmp, "resumed", {**values, **overrides}, num_processes=1, env={"SLURM_RESTART_COUNT": "1"})
        return out

    return dict(zip((2, 1), concurrently(restart, requeued_on_one_process)))


def test_a_signal_on_one_rank_makes_every_rank_save_the_same_step_and_stop_with_the_preemption_code(preempted_run):
    out, _, result = preempted_run
    assert result.returncode != 0
    assert "SIGTERM received: finishing this optimizer step" in result.stderr  # rank 1
    assert "preempted: a signal on another rank: every rank finished step 4" in result.stderr  # rank 0 says it
    assert re.search(r"exitcode\s*:\s*75", result.stderr)  # the launcher reports the ranks' preemption code
    # the one traceback is the launcher's own, reporting the ranks' exit codes; no rank printed one
    assert result.stderr.count("Traceback") == 1 and "ChildFailedError" in result.stderr
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000003", "step-00000004"]
    assert (out / "checkpoints" / "PREEMPTED").read_text().strip() == "step-00000004"
    assert not (out / "model.safetensors").exists()


def test_the_preempted_run_started_again_resumes_by_itself_with_identical_losses_and_bitwise_equal_weights(
    reference_run, resumed
):
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
    assert [e["step"] for e in read_metrics(out) if e.get("event") == "resumed"] == [PREEMPTED_AT]
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000009", "step-00000012"]  # save_total_limit 2
    assert not (out / "checkpoints" / "PREEMPTED").exists()  # finished: a later start is a new run
    # The exact match before training was measured by the interrupted run; the resumed one reads it from the log.
    reference_results = json.loads((reference_run / "eval_results.json").read_text())
    assert json.loads((out / "eval_results.json").read_text()) == reference_results  # lm-eval's last scores too
    # lm-eval's scores: step 3's kept from the interrupted run's log, the later ones those of the uninterrupted run
    resumed_scores, reference_scores = benchmark_scores(out), benchmark_scores(reference_run)
    assert sorted(resumed_scores) == [3, 6, 9, 12] and resumed_scores == reference_scores


def benchmark_scores(output_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("benchmark/")}
        for r in read_metrics(output_dir)
        if "benchmark_time_s" in r
    }


def test_the_preempted_run_resumes_on_another_world_size_as_a_requeued_job(reference_run, resumed):
    out, num_processes = resumed[1], 1
    assert [e["step"] for e in read_metrics(out) if e.get("event") == "resumed"] == [PREEMPTED_AT]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == num_processes and summary["distributed_type"] == "FSDP"
    assert summary["state_bytes_per_rank"] == summary["memory_estimate"]["rank_state_bytes_per_rank"]
    resumed_losses, expected = losses_by_step(out), losses_by_step(reference_run)
    # lm-eval on 1 process scores the whole task where 2 ranks split it: the same figures, up to the weights' rounding
    rolling = "benchmark/reverse_rolling/word_perplexity"
    assert benchmark_scores(out)[STEPS][rolling] == pytest.approx(
        benchmark_scores(reference_run)[STEPS][rolling], rel=1e-4
    )
    steps = list(range(PREEMPTED_AT + 1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([resumed_losses[s] for s in steps]),
        torch.tensor([expected[s] for s in steps]),
        rtol=1e-5,
        atol=1e-6,
    )
