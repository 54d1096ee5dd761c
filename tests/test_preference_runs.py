"""The preference family's launches beyond DPO's (tests/fixtures/preference.py): SimPO holds no reference model and
2 processes equal 1; KTO on 2 processes equals 1 process (its KL estimate is reduced over the global batch), and a
killed KTO run resumes exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_dpo_recipe import losses_of, step_records

from helpers.recipes import read_metrics

KTO_FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def summary_of(output_dir):
    return json.loads((output_dir / "run_summary.json").read_text())


@pytest.mark.slow
def test_simpo_holds_no_reference_model_and_two_ranks_equal_one_process(preference_launches, preference_followups):
    two, one = preference_launches["simpo"], preference_followups["simpo_one"]
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
def test_kto_on_two_ranks_equals_one_process(preference_followups):
    two, one = preference_followups["kto_resumed"], preference_followups["kto_one"]
    first = step_records(two)[1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0)
    assert first["kl"] == 0 and first["rewards/chosen"] == first["rewards/rejected"] == 0
    assert len(losses_of(two)) == 8
    torch.testing.assert_close(torch.tensor(losses_of(two)), torch.tensor(losses_of(one)), rtol=1e-5, atol=1e-6)
    for name in KTO_FIGURES:
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
    assert all(held["reference_model"] > 0 for held in summary["state_bytes_per_rank"])
    evaluations = [r for r in read_metrics(two) if "eval_loss" in r]
    assert evaluations[-1]["eval_samples"] == 32 and "eval_kl" in evaluations[-1]
    assert evaluations[-1]["eval_loss"] < math.inf and (two / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_killed_kto_run_resumes_exactly(preference_launches, preference_followups):
    """The steps the killed run took after its last checkpoint (4 to 6) are taken again after the resume with
    identical losses and figures."""
    assert preference_launches["killed"][2].returncode != 0
    records = [r for r in read_metrics(preference_followups["kto_resumed"]) if "loss" in r]
    before = {r["step"]: r for r in records[:6]}  # the killed attempt logged steps 1-6
    after = step_records(preference_followups["kto_resumed"])
    assert sorted(before) == [1, 2, 3, 4, 5, 6] and sorted(after) == list(range(1, 9))
    for step in (4, 5, 6):
        assert after[step]["loss"] == before[step]["loss"]
        assert all(after[step][name] == before[step][name] for name in KTO_FIGURES)
    resumed = [r for r in read_metrics(preference_followups["kto_resumed"]) if r.get("event") == "resumed"]
    assert len(resumed) == 1


@pytest.mark.slow
def test_kto_with_precomputed_reference_values_equals_the_sharded_copy(preference_followups):
    """Both rows of every example (its completion and its KL row) precomputed before the first step, by content."""
    from fsdp_recipes.train import reference

    precomputed, copy = preference_followups["kto_precomputed"], preference_followups["kto_one"]
    tables = reference.read_tables(precomputed)
    assert len(tables["train"]) == 128 and len(tables["eval"]) == 32
    assert summary_of(precomputed)["reference"].startswith("precomputed before training (128 pairs of rows")
    assert [held["reference_model"] for held in summary_of(precomputed)["state_bytes_per_rank"]] == [0]
    for name in ("loss", *KTO_FIGURES):
        torch.testing.assert_close(
            torch.tensor([step_records(precomputed)[s][name] for s in range(1, 9)]),
            torch.tensor([step_records(copy)[s][name] for s in range(1, 9)]),
            rtol=1e-5,
            atol=1e-6,
        )
