"""recipes/dpo.py: preference data, the DPO loss, the three reference modes. Real 2-process FSDP2 launches for what
distribution changes (parity, resume); one-process runs in this process for the rest."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.dpo import DPO_STEPS, dpo_values, run_dpo
from fsdp_recipes.common.faults import FAULT_ENV, InjectedFault
from fsdp_recipes.methods.preference import objectives, paired
from fsdp_recipes.train import losses
from helpers.launch import alongside
from helpers.recipes import read_metrics, recipe_error_in_process, run_recipe_in_process

FIGURES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def step_records(output_dir: Path) -> dict[int, dict]:
    """The last training record logged for each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


def losses_of(output_dir: Path) -> list[float]:
    records = step_records(output_dir)
    return [records[step]["loss"] for step in sorted(records)]


def assert_first_step_is_the_reference(output_dir: Path) -> None:
    """Before the first update the policy is the reference: every reward is 0 and the sigmoid loss is ln 2."""
    first = step_records(output_dir)[1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0
    assert first["rewards/accuracies"] == 0  # a tie is not a win
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0


# ------------------------------------------------------------------------------------------------ in-process runs
@pytest.fixture(scope="module")
def one_process_precomputed(tmp_path_factory, pretrained_tiny_model, preference_data) -> Path:
    """The reference run's global batch on one process (8 pairs per micro-batch), reference values precomputed."""
    tmp = tmp_path_factory.mktemp("dpo_one")
    run_recipe_in_process(
        "dpo",
        tmp,
        "one",
        dpo_values(
            pretrained_tiny_model,
            preference_data,
            tmp / "out",
            per_device_train_batch_size=8,
            precompute_ref_log_probs=True,
        ),
    )
    return tmp / "out"


@pytest.mark.slow
def test_two_ranks_with_a_sharded_reference_equal_one_process_with_precomputed_values(
    dpo_reference_run, one_process_precomputed
):
    for run in (dpo_reference_run, one_process_precomputed):
        assert_first_step_is_the_reference(run)
    two, one = losses_of(dpo_reference_run), losses_of(one_process_precomputed)
    assert len(two) == DPO_STEPS
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)
    records = step_records(dpo_reference_run)
    assert records[DPO_STEPS]["rewards/margins"] > 0 and records[DPO_STEPS]["loss"] < math.log(2)  # it learns
    summary = json.loads((dpo_reference_run / "run_summary.json").read_text())
    assert summary["reference"].startswith("a frozen copy sharded like the policy")
    assert summary["memory_estimate"]["predicted_per_gpu_bytes"]["reference_model"] > 0
    assert all(held["reference_model"] > 0 for held in summary["state_bytes_per_rank"])  # the copy's shard, each rank
    one_summary = json.loads((one_process_precomputed / "run_summary.json").read_text())
    assert one_summary["reference"].startswith("precomputed") and "reference_model" not in json.dumps(
        {k: v for k, v in one_summary["memory_estimate"]["predicted_per_gpu_bytes"].items() if v}
    )


@pytest.mark.slow
def test_values_precomputed_on_two_ranks_are_one_process_values(dpo_launches, one_process_precomputed):
    """Each rank computes its share of the pairs; gathered, every pair's values are the ones one process computes, and
    training on them gives the losses of one process and of the live reference."""
    from fsdp_recipes.methods.preference import reference

    two_ranks = dpo_launches["precomputed"]
    tables = [reference.read_tables(run) for run in (two_ranks, one_process_precomputed)]  # output_dir holds them too
    assert tables[0].keys() == tables[1].keys() == {"train", "eval"}
    for split in tables[0]:
        assert tables[0][split].keys() == tables[1][split].keys() and len(tables[0][split]) in (64, 16)
        torch.testing.assert_close(
            torch.tensor([tables[0][split][i] for i in sorted(tables[0][split])]),
            torch.tensor([tables[1][split][i] for i in sorted(tables[1][split])]),
            rtol=1e-5,
            atol=1e-5,
        )
    assert_first_step_is_the_reference(two_ranks)
    assert len(losses_of(two_ranks)) == DPO_STEPS
    for other in (one_process_precomputed, dpo_launches["reference"]):
        torch.testing.assert_close(
            torch.tensor(losses_of(two_ranks)), torch.tensor(losses_of(other)), rtol=1e-5, atol=1e-6
        )


@pytest.mark.slow
def test_held_out_figures_use_trls_names_and_the_model_is_exported(dpo_reference_run):
    evaluations = [r for r in read_metrics(dpo_reference_run) if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [4, 8]
    for name in FIGURES:
        assert f"eval_{name}" in evaluations[-1] and f"{name}" in step_records(dpo_reference_run)[DPO_STEPS]
    assert evaluations[-1]["eval_samples"] == 16
    results = json.loads((dpo_reference_run / "eval_results.json").read_text())
    assert results["eval_rewards/accuracies"] == evaluations[-1]["eval_rewards/accuracies"]
    assert (dpo_reference_run / "model.safetensors").is_file() and "dpo" in (
        dpo_reference_run / "README.md"
    ).read_text()


LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2, save_steps=None)


@pytest.fixture(scope="module")
def followups(tmp_path_factory, dpo_launches, pretrained_tiny_model, preference_data) -> dict[str, Path]:
    """Launched side by side: the killed run resumed from its latest checkpoint, and LoRA DPO on 2 processes; and
    meanwhile LoRA DPO on 1 process, here. {name: output_dir}."""
    tmp = tmp_path_factory.mktemp("dpo_followups")
    source, values, _ = dpo_launches["killed"]
    shutil.copytree(source, tmp / "resumed")
    alongside(
        lambda: run_recipe_in_process(
            "dpo",
            tmp,
            "lora_one",
            dpo_values(pretrained_tiny_model, preference_data, tmp / "lora_one", per_device_train_batch_size=8, **LORA),
        ),
        lambda: run_dpo(
            tmp, "resumed", {**values, "output_dir": str(tmp / "resumed"), "resume_from_checkpoint": "latest"}
        ),
        lambda: run_dpo(tmp, "lora_two", dpo_values(pretrained_tiny_model, preference_data, tmp / "lora_two", **LORA)),
    )
    return {name: tmp / name for name in ("resumed", "lora_two", "lora_one")}


@pytest.mark.slow
def test_a_killed_run_resumes_with_identical_losses_and_bitwise_equal_weights(dpo_launches, followups):
    assert dpo_launches["killed"][2].returncode != 0
    out = followups["resumed"]
    resumed, reference = step_records(out), step_records(dpo_launches["reference"])
    assert [resumed[s]["loss"] for s in sorted(resumed)] == [reference[s]["loss"] for s in sorted(reference)]
    assert all(resumed[s][name] == reference[s][name] for s in resumed for name in FIGURES)
    weights = load_file(out / "model.safetensors")
    expected = load_file(dpo_launches["reference"] / "model.safetensors")
    assert all(torch.equal(weights[key], expected[key]) for key in expected)


@pytest.mark.slow
def test_lora_dpo_uses_the_policy_without_adapters_as_reference(followups):
    """2 processes under FSDP2 and 1 process give the same losses; no second model."""
    two, one = followups["lora_two"], followups["lora_one"]
    for run in (two, one):
        assert_first_step_is_the_reference(run)
        summary = json.loads((run / "run_summary.json").read_text())
        assert summary["reference"].startswith("the policy with its LoRA adapters disabled")
        assert (run / "adapter_model.safetensors").is_file()
    torch.testing.assert_close(torch.tensor(losses_of(two)), torch.tensor(losses_of(one)), rtol=1e-5, atol=1e-6)
    assert losses_of(two)[-1] < math.log(2)


def test_precomputed_values_survive_a_resume(
    tmp_path, one_process_precomputed, pretrained_tiny_model, preference_data, monkeypatch
):
    """A run that fails after step 4 (its last checkpoint is step 3's) resumes with the values it stored before its
    first step, not values from the half-trained policy: its losses are the uninterrupted run's."""
    values = dpo_values(
        pretrained_tiny_model,
        preference_data,
        tmp_path / "out",
        per_device_train_batch_size=8,
        precompute_ref_log_probs=True,
    )
    monkeypatch.setenv(FAULT_ENV, "raise-after-step:4")
    with pytest.raises(InjectedFault):
        run_recipe_in_process("dpo", tmp_path, "failed", values)
    monkeypatch.delenv(FAULT_ENV)
    run_recipe_in_process("dpo", tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    assert losses_of(tmp_path / "out") == losses_of(one_process_precomputed)


def resume_values_of(out: Path) -> dict:
    """The values the run in `out` was trained with (its latest checkpoint's recipe config), resumed for 2 more steps."""
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    values = json.loads((checkpoint / "model" / "recipe_config.json").read_text())
    values = {k: v for k, v in values.items() if v is not None}
    return {**values, "output_dir": str(out), "resume_from_checkpoint": "latest", "max_steps": DPO_STEPS + 2}


def test_resuming_with_precomputed_values_that_are_gone_is_refused(tmp_path, one_process_precomputed, capsys):
    out = shutil.copytree(one_process_precomputed, tmp_path / "out")
    for stored in out.rglob("reference_log_probs.json"):  # output_dir's copy and each checkpoint's
        stored.unlink()
    error = recipe_error_in_process("dpo", tmp_path, resume_values_of(out), capsys)
    assert "reference_log_probs.json" in error and "cannot be recomputed" in error


def test_precomputed_values_are_found_by_content_and_edited_pairs_are_refused(
    tmp_path, one_process_precomputed, preference_data, capsys
):
    """The values are kept in every checkpoint, keyed by each pair's content: data with one pair edited (same count,
    the change of dataset_name allowed) is refused before loading, naming the pair, instead of giving that pair
    another's values; nothing of the run is rewritten."""
    out = shutil.copytree(one_process_precomputed, tmp_path / "out")
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert json.loads((checkpoint / "reference_log_probs.json").read_text())["keyed_by"] == "content"
    edited = shutil.copytree(preference_data, tmp_path / "edited")
    lines = (edited / "train.jsonl").read_text().splitlines()
    pair = json.loads(lines[5])
    pair["rejected"], pair["chosen"] = pair["chosen"], pair["rejected"]
    lines[5] = json.dumps(pair)
    (edited / "train.jsonl").write_text("\n".join(lines) + "\n")
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    values = {**resume_values_of(out), "dataset_name": str(edited), "allow_config_change": ["dataset_name"]}
    error = recipe_error_in_process("dpo", tmp_path, values, capsys)
    assert "1 of the 64 train pairs have no precomputed reference value" in error and "(pair 5)" in error
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_an_objective_changed_on_resume_is_refused_unless_allowed_and_then_recorded(
    tmp_path, one_process_precomputed, pretrained_tiny_model, preference_data, capsys
):
    out = shutil.copytree(one_process_precomputed, tmp_path / "out")
    values = dpo_values(
        pretrained_tiny_model,
        preference_data,
        out,
        per_device_train_batch_size=8,
        precompute_ref_log_probs=True,
        resume_from_checkpoint="latest",
        max_steps=DPO_STEPS + 1,
        beta=0.25,
        label_smoothing=0.1,
    )
    error = recipe_error_in_process("dpo", tmp_path, values, capsys)
    assert (
        "other settings that change the objective or the data (beta: 0.5 -> 0.25; label_smoothing: 0.0 -> 0.1)" in error
    )
    assert (out / "metrics.jsonl").read_text() == (one_process_precomputed / "metrics.jsonl").read_text()
    run_recipe_in_process("dpo", tmp_path, "allowed", {**values, "allow_config_change": ["beta", "label_smoothing"]})
    (resumed,) = [r for r in read_metrics(out) if r.get("event") == "resumed"]
    assert resumed["config_changes"] == {"beta": [0.5, 0.25], "label_smoothing": [0.0, 0.1]}
    assert max(step_records(out)) == DPO_STEPS + 1


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "rows, overrides, expected",
    [
        (
            [{"prompt": "a", "answer": "b"}],
            {},
            "columns ['answer', 'prompt'], but preference tuning needs 'prompt', 'chosen'",
        ),
        (
            [{"prompt": "reverse: abc", "chosen": "cba", "rejected": "cba"}],
            {},
            "pair 0 of the train split: 'chosen' and 'rejected' are the same",
        ),
        (
            [{"prompt": "reverse: " + "a" * 80, "chosen": "cba", "rejected": "abc"}],
            {},
            "pair 0 of the train split: its chosen answer has no token left after truncation to max_length=48",
        ),
        ([{"prompt": "p", "chosen": "a", "rejected": "b"}], {"beta": 0}, "beta must be a number > 0, got 0"),
        ([{"prompt": "p", "chosen": "a", "rejected": "b"}], {"loss_type": "kto"}, "loss_type 'kto' is not one of"),
        (
            [{"prompt": "p", "chosen": "a", "rejected": "b"}],
            {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
            "loss_weights has 1 weights for the 2 losses of loss_type ['sigmoid', 'sft']",
        ),
        (
            [{"prompt": "p", "chosen": "a", "rejected": "b"}],
            {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, -0.5]},
            "loss_weights must be numbers >= 0, got [1.0, -0.5]",
        ),
        (
            [{"prompt": "p", "chosen": "a", "rejected": "b"}],
            {"loss_type": "orpo", "precompute_ref_log_probs": True},
            "loss_type orpo needs no reference, so there is nothing to precompute",
        ),
    ],
)
def test_bad_input_is_one_error_before_loading(tmp_path, pretrained_tiny_model, rows, overrides, expected, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 4))
    values = dpo_values(pretrained_tiny_model, data, tmp_path / "out", eval_split_size=0, **overrides)
    assert expected in recipe_error_in_process("dpo", tmp_path, values, capsys)


# ------------------------------------------------------------------------------------------------ data and loss
def test_the_loss_of_a_batch_is_the_formula_on_independent_log_probs(tokenizer, pretrained_tiny_model):
    """Summed completion log-probabilities from the chunked loss equal log_softmax + gather over whole logits; the DPO
    loss of each type equals the formula written out on them."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    data = Dataset.from_dict(
        {"prompt": ["reverse: abc", "reverse: hello"], "chosen": ["cba", "olleh"], "rejected": ["bca", "hello"]}
    )
    pairs, _ = paired.tokenize_pairs(data, tokenizer, max_length=64)
    batch = paired.PairCollator(tokenizer.pad_token_id)(list(pairs))
    policy = AutoModelForCausalLM.from_pretrained(pretrained_tiny_model, dtype=torch.float32)
    token_loss = losses.TokenLoss(policy)
    with torch.no_grad():
        summed = losses.sequence_log_probs(token_loss.token_losses(policy, batch))
        logits = policy(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.log_softmax(-1)
    targets = batch["targets"]
    independent = torch.stack(
        [
            sum(logits[r, t, targets[r, t]] for t in range(targets.shape[1]) if targets[r, t] != losses.IGNORE_INDEX)
            for r in range(targets.shape[0])
        ]
    )
    torch.testing.assert_close(summed, independent, rtol=1e-5, atol=1e-5)
    pc, pr = summed.chunk(2)
    rc, rr = pc - torch.tensor([0.3, -0.2]), pr + torch.tensor([0.1, 0.4])  # a reference the policy has moved from
    h = (pc - rc) - (pr - rr)
    beta = 0.5
    lengths = (targets != losses.IGNORE_INDEX).sum(1).chunk(2)

    def loss(loss_type, **options):
        objective = objectives.PreferenceLoss((loss_type,), (1.0,), beta, **options)
        return objective(pc, pr, rc, rr, *lengths)

    sigmoid = loss("sigmoid", label_smoothing=0.1)
    torch.testing.assert_close(
        sigmoid.loss, -0.9 * torch.log(torch.sigmoid(beta * h)) - 0.1 * torch.log(torch.sigmoid(-beta * h))
    )
    torch.testing.assert_close(sigmoid.chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(sigmoid.rejected_rewards, beta * (pr - rr))
    torch.testing.assert_close(loss("hinge").loss, torch.clamp(1 - beta * h, min=0))
    ipo = loss("ipo").loss
    torch.testing.assert_close(ipo, ((pc - rc) / lengths[0] - (pr - rr) / lengths[1] - 1 / (2 * beta)) ** 2)
    same = objectives.PreferenceLoss(("sigmoid",), (1.0,), beta)(pc, pr, pc, pr, *lengths)
    assert torch.equal(same.loss, torch.full((2,), math.log(2)))
    assert not same.chosen_rewards.any() and not same.rejected_rewards.any()
