"""Which checkpoints a run may write next to, and pruning, on hand-made checkpoint folders (no training)."""

from __future__ import annotations

import json

from fsdp_recipes.train.checkpoint import (
    CHECKPOINTS,
    LATEST,
    PROGRESS,
    checkpoint_conflict,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
)


def make_checkpoints(output_dir, *steps, latest=None):
    root = output_dir / CHECKPOINTS
    for step in steps:
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / PROGRESS).write_text(json.dumps({"step": step}))
    (root / ".staging-step-00000099").mkdir()  # a save killed midway: never counts
    (root / LATEST).write_text(f"step-{(latest or steps[-1]):08d}\n")
    return root


def test_a_new_run_may_not_mix_its_checkpoints_with_an_earlier_runs(tmp_path):
    assert checkpoint_conflict(tmp_path, None) is None
    make_checkpoints(tmp_path, 10, 20)
    problem = checkpoint_conflict(tmp_path, None)
    assert "earlier run" in problem and "step-00000020" in problem and "--resume_from_checkpoint latest" in problem


def test_resuming_from_the_newest_is_fine_from_an_older_one_is_not(tmp_path):
    root = make_checkpoints(tmp_path, 10, 20)
    assert checkpoint_conflict(tmp_path, root / "step-00000020") is None
    problem = checkpoint_conflict(tmp_path, root / "step-00000010")
    assert "newer checkpoints exist (step-00000020)" in problem


def test_resuming_from_another_folder_into_one_with_checkpoints_is_refused(tmp_path):
    other = make_checkpoints(tmp_path / "other", 5)
    make_checkpoints(tmp_path / "out", 10)
    assert "earlier run" in checkpoint_conflict(tmp_path / "out", other / "step-00000005")


def test_pruning_keeps_the_newest_and_never_latest(tmp_path):
    make_checkpoints(tmp_path, 10, 20, 30, 40, latest=10)
    removed = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in removed] == ["step-00000020"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000010", "step-00000030", "step-00000040"]
    assert latest_checkpoint(tmp_path).name == "step-00000010"
