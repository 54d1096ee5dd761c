"""Checkpoints under real 2-process FSDP2 launches: interrupted runs resume exactly, on the same or another world
size; a save killed midway leaves the previous checkpoint as `latest`; pruning keeps the newest K."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SFT, base_recipe_values, launch, read_metrics, recipe_config, require_success
from fsdp_recipes.checkpoint import complete_checkpoints, latest_checkpoint

pytestmark = pytest.mark.slow
STEPS = 12


def values_for(tiny_model_config, chat_data, output_dir: Path, **overrides) -> dict:
    # Accumulation over 2 micro-batches and 64 rows of data per epoch: steps 1-4 are epoch 0, so the interruption
    # at step 6 falls mid-epoch (epoch 1) and the run crosses two epoch boundaries.
    defaults = dict(max_steps=STEPS, save_steps=3, gradient_accumulation_steps=2, eval_steps=None, packing=False)
    defaults.update(overrides)
    return base_recipe_values(tiny_model_config, chat_data, output_dir, **defaults)


def run(tmp: Path, name: str, values: dict, *, env=None, num_processes=2, expect_success=True):
    config = recipe_config(tmp / f"{name}.yaml", **values)
    result = launch(SFT, ["--config", str(config)], env=env, num_processes=num_processes)
    if expect_success:
        require_success(result)
    return result


def losses_by_step(output_dir: Path) -> dict[int, float]:
    """The last loss logged for each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_config, chat_data):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    data = chat_data_subset(tmp, chat_data)
    run(tmp, "full", values_for(tiny_model_config, data, tmp / "out"))
    return tmp / "out", data


def chat_data_subset(tmp: Path, chat_data: Path) -> Path:
    folder = tmp / "data"
    folder.mkdir()
    lines = (chat_data / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (folder / "test.jsonl").write_text((chat_data / "test.jsonl").read_text())
    return folder


@pytest.fixture(scope="module")
def killed_at_step_7(tmp_path_factory, uninterrupted, tiny_model_config):
    """The same run, killed (every rank SIGKILLed) right after step 7: its latest checkpoint is step 6's."""
    _, data = uninterrupted
    tmp = tmp_path_factory.mktemp("killed")
    values = values_for(tiny_model_config, data, tmp / "out")
    killed = run(tmp, "killed", values, env={"FSDP_RECIPES_FAULT": "kill-after-step:7"}, expect_success=False)
    assert killed.returncode != 0
    return tmp / "out", values


def copy_of(killed_at_step_7, tmp_path: Path) -> tuple[Path, dict]:
    source, values = killed_at_step_7
    out = tmp_path / "out"
    shutil.copytree(source, out)
    return out, {**values, "output_dir": str(out)}


def test_killed_run_resumes_with_identical_losses_and_bitwise_equal_weights(tmp_path, uninterrupted, killed_at_step_7):
    reference, _ = uninterrupted
    out, values = copy_of(killed_at_step_7, tmp_path)
    assert latest_checkpoint(out).name == "step-00000006"
    assert not (out / "model.safetensors").exists()

    run(tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    resumed_losses, reference_losses = losses_by_step(out), losses_by_step(reference)
    assert sorted(resumed_losses) == list(range(1, STEPS + 1))
    assert resumed_losses == reference_losses  # exactly equal, step for step
    resumed_weights, reference_weights = weights(out), weights(reference)
    assert resumed_weights.keys() == reference_weights.keys()
    for key in reference_weights:
        assert torch.equal(resumed_weights[key], reference_weights[key]), key
    events = [r for r in read_metrics(out) if r.get("event") == "resumed"]
    assert [e["step"] for e in events] == [6]


@pytest.mark.parametrize("num_processes", [1, 4])
def test_resume_on_another_world_size(tmp_path, uninterrupted, killed_at_step_7, num_processes):
    reference, _ = uninterrupted
    out, values = copy_of(killed_at_step_7, tmp_path)
    per_device = 8 // num_processes  # the same global batch: 2 processes x 4 rows
    run(tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest", "per_device_train_batch_size": per_device},
        num_processes=num_processes)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == num_processes and summary["distributed_type"] == "FSDP"
    resumed, expected = losses_by_step(out), losses_by_step(reference)
    steps = list(range(7, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([resumed[s] for s in steps]), torch.tensor([expected[s] for s in steps]), rtol=1e-5, atol=1e-6
    )


def test_resume_with_a_different_global_batch_is_refused(tmp_path, killed_at_step_7):
    out, values = copy_of(killed_at_step_7, tmp_path)
    result = run(tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest", "per_device_train_batch_size": 3},
                 expect_success=False)
    assert result.returncode != 0
    assert "error: the checkpoint stopped" in result.stderr
    assert "per_device_train_batch_size x processes equal to the original (4 x 2)" in result.stderr


def test_save_killed_midway_leaves_the_previous_checkpoint_as_latest(tmp_path, uninterrupted, tiny_model_config):
    _, data = uninterrupted
    out = tmp_path / "out"
    values = values_for(tiny_model_config, data, out, max_steps=9)
    result = run(tmp_path, "killed", values, env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"}, expect_success=False)
    assert result.returncode != 0
    assert latest_checkpoint(out).name == "step-00000003"
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000003"]
    assert list((out / "checkpoints").glob(".staging-*"))  # the half-written save is there, and ignored
    run(tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    assert [r["step"] for r in read_metrics(out) if r.get("event") == "resumed"] == [3]
    assert not list((out / "checkpoints").glob(".staging-*"))
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000003", "step-00000006", "step-00000009"]
