"""The preference family's runs beyond DPO's (tests/fixtures/preference.py: SimPO and KTO each on 2 processes, their
1-process twins in-process): SimPO holds no reference model and 2 processes equal 1; KTO on 2 processes (a sharded
reference copy, the KL estimate reduced over the global batch) equals 1 process with precomputed reference values;
an interrupted KTO run resumes exactly (in-process)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_dpo_recipe import losses_of, step_records

from fixtures.preference import kto_one_process_values
from fsdp_recipes.common.faults import FAULT_ENV, InjectedFault
from helpers.recipes import read_metrics, run_recipe_in_process

KTO_FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def summary_of(output_dir):
    return json.loads((output_dir / "run_summary.json").read_text())


@pytest.mark.slow
def test_simpo_holds_no_reference_model_and_two_ranks_equal_one_process(preference_runs):
    two, one = preference_runs["simpo_two"], preference_runs["simpo_one"]
    for run in (two, one):
        summary = summary_of(run)
        assert summary["reference"].startswith("none: loss_type simpo needs no reference model")
        assert "no reference model" in summary["loss"]
        assert [held["reference_model"] for held in summary["state_bytes_per_rank"]] == [0] * len(
            summary["state_bytes_per_rank"]
        )
        assert not summary["memory_estimate"]["predicted_per_gpu_bytes"].get("reference_model")
        assert not (run / "reference_log_probs.json").exists()  # and no precompute pass
    assert len(summary_of(two)["state_bytes_per_rank"]) == 2
    torch.testing.assert_close(torch.tensor(losses_of(two)), torch.tensor(losses_of(one)), rtol=1e-5, atol=1e-6)
    records = step_records(two)
    assert records[max(records)]["rewards/margins"] > records[1]["rewards/margins"]  # it learns


@pytest.mark.slow
def test_kto_with_a_sharded_copy_on_two_ranks_equals_one_process_with_precomputed_values(preference_runs):
    """The 2-process run computes the reference with a frozen copy sharded like the policy; the 1-process twin
    precomputes both rows of every example (its completion and its KL row) before the first step, by content. Losses
    and every figure (the KL estimate included) agree."""
    from fsdp_recipes.methods.preference import reference

    two, one = preference_runs["kto_two"], preference_runs["kto_one"]
    first = step_records(two)[1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0)
    assert first["kl"] == 0 and first["rewards/chosen"] == first["rewards/rejected"] == 0
    assert len(losses_of(two)) == 8
    for name in ("loss", *KTO_FIGURES):
        torch.testing.assert_close(
            torch.tensor([step_records(two)[s][name] for s in range(1, 9)]),
            torch.tensor([step_records(one)[s][name] for s in range(1, 9)]),
            rtol=1e-5,
            atol=1e-6,
        )
    assert max(step_records(two)[s]["kl"] for s in range(2, 9)) > 0  # the policy moves from the reference
    summary = summary_of(two)
    assert summary["data"]["unpaired"].startswith("64 preference pairs unpaired into 128 examples")
    assert summary["reference"].startswith("a frozen copy sharded like the policy")
    assert len(summary["state_bytes_per_rank"]) == 2
    assert all(held["reference_model"] > 0 for held in summary["state_bytes_per_rank"])
    evaluations = [r for r in read_metrics(two) if "eval_loss" in r]
    assert evaluations[-1]["eval_samples"] == 32 and "eval_kl" in evaluations[-1]
    assert evaluations[-1]["eval_loss"] < math.inf and (two / "model.safetensors").is_file()
    tables = reference.read_tables(one)
    assert len(tables["train"]) == 128 and len(tables["eval"]) == 32
    assert summary_of(one)["reference"].startswith("precomputed before training (128 pairs of rows")
    assert [held["reference_model"] for held in summary_of(one)["state_bytes_per_rank"]] == [0]


@pytest.mark.slow
def test_an_interrupted_kto_run_resumes_exactly(
    tmp_path, preference_runs, pretrained_tiny_model, preference_data, monkeypatch
):
    """The 1-process twin's settings, failing after step 6 (before logging or saving it: its last checkpoint is step
    3's) and resumed in-process: the steps it logged after that checkpoint (4 and 5) are logged again with the same
    figures, every step logs what the uninterrupted twin logged, and the final weights are bitwise the twin's
    (reference values recomputed with the half-trained policy instead of read from the checkpoint would change
    them)."""
    whole = preference_runs["kto_one"]
    values = kto_one_process_values(pretrained_tiny_model, preference_data, tmp_path / "out")
    monkeypatch.setenv(FAULT_ENV, "raise-after-step:6")
    with pytest.raises(InjectedFault):
        run_recipe_in_process("kto", tmp_path, "failed", values)
    monkeypatch.delenv(FAULT_ENV)
    before = step_records(tmp_path / "out")
    assert sorted(before) == [1, 2, 3, 4, 5]
    run_recipe_in_process("kto", tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    after, uninterrupted = step_records(tmp_path / "out"), step_records(whole)
    assert sorted(after) == sorted(uninterrupted) == list(range(1, 9))
    for step in (4, 5):
        assert all(after[step][name] == before[step][name] for name in ("loss", *KTO_FIGURES))
    for step in after:
        assert all(after[step][name] == uninterrupted[step][name] for name in ("loss", *KTO_FIGURES)), step
    for name, tensor in load_file(whole / "model.safetensors").items():
        assert torch.equal(tensor, load_file(tmp_path / "out" / "model.safetensors")[name]), name
    resumed = [r for r in read_metrics(tmp_path / "out") if r.get("event") == "resumed"]
    assert len(resumed) == 1
