"""Faults met once the loop runs, in this process (no launch): a step whose gradients are not finite stops every
recipe at that step with one `error:` line (the progress bar open), before the update and with nothing exported or
saved; `skip_nonfinite_steps` skips such a step instead and counts it. Between processes the same stop holds because
the gradient norm is one global value (tests/test_all_ranks_stop.py shows a rank's error stopping all). A preemption
between processes, and its restart: tests/test_checkpoint_resume.py; the watch itself is tested here."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers.recipes import base_recipe_values, read_metrics, run_recipe_in_process

# The check is in the one optimizer step every recipe calls; one recipe of each loop family runs it here: token losses
# (sft; pretrain and distill alike), pairs with a reference (dpo; kto and reward alike), rollouts (grpo), a classifier.
RECIPE_FAMILIES = ("sft", "dpo", "grpo", "classify")


def stopped_run(recipe: str, tmp: Path, values: dict, capsys) -> tuple[int, list[str], str]:
    with pytest.raises(SystemExit) as stop:
        run_recipe_in_process(recipe, tmp, recipe, values)
    stderr = capsys.readouterr().err
    return stop.value.code, [line for line in stderr.splitlines() if line.startswith("error:")], stderr


@pytest.mark.parametrize("recipe", RECIPE_FAMILIES)
def test_a_step_with_gradients_that_are_not_finite_stops_every_recipe_family_with_one_error_line(
    recipe, short_run_values, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FSDP_RECIPES_FAULT", "nan-before-step:2")
    output = tmp_path / "out"
    code, errors, stderr = stopped_run(recipe, tmp_path, short_run_values(recipe)(output), capsys)
    assert code == 2 and "Traceback" not in stderr
    assert len(errors) == 1 and errors[0].startswith("error: step 2: the gradient norm is nan"), errors
    assert "lower learning_rate" in errors[0] and "skip_nonfinite_steps" in errors[0]
    assert not list(output.glob("*.safetensors")) and not (output / "checkpoints").exists()


def digests(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in ("metrics.jsonl", "run_summary.json", "training_curves.png")
    }


@pytest.fixture(scope="module")
def two_steps_saved(tmp_path_factory, tiny_model_config, small_chat_data) -> tuple[Path, dict]:
    """An SFT run of 2 steps, checkpointed at step 2 and exported: what a later fault must leave as it is."""
    tmp = tmp_path_factory.mktemp("saved")
    values = base_recipe_values(
        tiny_model_config, small_chat_data, tmp / "out", max_steps=2, save_steps=2, warmup_steps=0,
        exact_match_eval_samples=0, eval_steps=None,
    )  # fmt: skip
    run_recipe_in_process("sft", tmp, "first", values)
    return tmp / "out", values


def resumed_copy(two_steps_saved, tmp_path: Path, **overrides) -> tuple[Path, dict]:
    source, values = two_steps_saved
    output = tmp_path / "out"
    shutil.copytree(source, output)
    return output, {**values, "output_dir": str(output), "resume_from_checkpoint": "latest", **overrides}


def test_a_blow_up_after_a_checkpoint_leaves_the_model_folder_and_the_checkpoint_as_they_were(
    two_steps_saved, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FSDP_RECIPES_FAULT", "nan-before-step:3")
    output, values = resumed_copy(two_steps_saved, tmp_path, max_steps=4, save_steps=1)
    before = digests(output)
    code, errors, stderr = stopped_run("sft", tmp_path, values, capsys)
    assert code == 2 and "Traceback" not in stderr and len(errors) == 1
    assert errors[0].startswith("error: step 3: the gradient norm is nan") and "(step-00000002)" in errors[0]
    assert digests(output) == before  # model.safetensors, its config and card, step 2's checkpoint: byte for byte


def test_a_diverging_learning_rate_stops_at_the_first_step_that_is_not_finite(
    tiny_model_config, small_chat_data, tmp_path, capsys
):
    values = base_recipe_values(
        tiny_model_config, small_chat_data, tmp_path / "out", max_steps=6, learning_rate=1e30, warmup_steps=0,
        save_steps=1, exact_match_eval_samples=0, eval_steps=None,
    )  # fmt: skip
    code, errors, stderr = stopped_run("sft", tmp_path, values, capsys)
    assert code == 2 and "Traceback" not in stderr and len(errors) == 1, stderr[-2000:]
    stopped_at = int(errors[0].removeprefix("error: step ").split(":")[0])
    assert "the gradient norm is " in errors[0]
    finite = [record["step"] for record in read_metrics(tmp_path / "out") if "loss" in record]
    assert finite == list(range(1, stopped_at))  # every step before it trained and was logged; it was not
    saved = sorted(path.name for path in (tmp_path / "out" / "checkpoints").glob("step-*"))
    assert saved[-1] == f"step-{stopped_at - 1:08d}" and not (tmp_path / "out" / "model.safetensors").exists()


def test_skip_nonfinite_steps_skips_the_update_counts_it_and_finishes(two_steps_saved, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_RECIPES_FAULT", "nan-before-step:3")
    output, values = resumed_copy(two_steps_saved, tmp_path, max_steps=4, skip_nonfinite_steps=1, save_steps=None)
    run_recipe_in_process("sft", tmp_path, "skipping", values)
    events = [record for record in read_metrics(output) if record.get("event") == "skipped_nonfinite_step"]
    assert [(event["step"], event["skipped_nonfinite_steps"]) for event in events] == [(3, 1)]
    assert json.loads((output / "run_summary.json").read_text())["optimizer_steps"] == 4
    assert (output / "model.safetensors").exists()  # exported and verified by the run itself


def test_a_resumed_run_trains_with_the_learning_rate_it_is_given_not_the_checkpoints(two_steps_saved, tmp_path):
    """The optimizer state in a checkpoint carries its learning rate and hyperparameters; a value changed for the
    resumed run (a free field) takes effect instead of being overridden by it in silence."""
    import math

    output, values = resumed_copy(two_steps_saved, tmp_path, max_steps=4, learning_rate=1e-3, save_steps=None)
    run_recipe_in_process("sft", tmp_path, "new_lr", values)
    logged = {record["step"]: record["lr"] for record in read_metrics(output) if "lr" in record}
    # cosine over 4 steps from the new peak, no warmup: after step 3 the schedule's factor is (1 + cos(3π/4)) / 2
    assert logged[3] == pytest.approx(1e-3 * (1 + math.cos(math.pi * 3 / 4)) / 2, rel=1e-6)


def test_the_preemption_watch_notes_the_first_signal_and_gives_the_handlers_back():
    import os
    import signal
    import threading
    from types import SimpleNamespace

    from fsdp_recipes.train.preemption import PreemptionWatch

    single = SimpleNamespace(device="cpu", num_processes=1)
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(["SIGUSR1", "SIGTERM"])
    assert not watch.requested(single)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal (during the save) changes nothing
    assert watch.received == "SIGUSR1" and watch.requested(single)
    watch.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    elsewhere = []  # a run driven from another thread cannot set handlers: it keeps the defaults, and runs
    thread = threading.Thread(target=lambda: elsewhere.append(PreemptionWatch(["SIGTERM"])))
    thread.start()
    thread.join()
    assert elsewhere and elsewhere[0].received is None


def test_a_preempted_runs_deleted_checkpoint_is_named_when_an_older_one_is_resumed(tmp_path):
    from fsdp_recipes.train import preemption

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-00000004").mkdir(parents=True)
    (checkpoints / "step-00000004" / "progress.json").write_text("{}")
    (checkpoints / "latest").write_text("step-00000004\n")
    assert preemption.automatic_resume(tmp_path) is None  # neither preempted nor restarted: no resume by itself
    (checkpoints / "PREEMPTED").write_text("step-00000004\n")
    assert preemption.automatic_resume(tmp_path).endswith("was preempted: resuming from step-00000004")
    (checkpoints / "PREEMPTED").write_text("step-00000008\n")  # saved, then deleted by hand
    reason = preemption.automatic_resume(tmp_path)
    assert "the checkpoint it saved (step-00000008) is gone: resuming from step-00000004" in reason
