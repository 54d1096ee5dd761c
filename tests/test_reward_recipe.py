"""recipes/reward.py: the Bradley-Terry loss and accuracy against a direct computation, pooling and every error raised
before weights load, in this process; the shared runs (tests/fixtures/reward_distill.py) show 2 ranks equal to
1 process and an exported folder that scores pairs as the trained model did, and an interrupted copy of the 1-process
run, resumed in this process, equals it exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file

from fixtures.reward_distill import REWARD_STEPS, reward_one_values, reward_values
from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.common.faults import FAULT_ENV, InjectedFault
from fsdp_recipes.methods.preference import paired
from fsdp_recipes.methods.reward import reward_model
from helpers.data import write_jsonl
from helpers.paths import REPO, TOKENIZER
from helpers.recipes import read_metrics, recipe_error_in_process, run_recipe_in_process


def step_records(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


# ----------------------------------------------------------------------------------------- the loss, in this process
def test_bradley_terry_loss_and_accuracy_equal_a_direct_computation():
    chosen = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rejected = torch.tensor([1.0, 0.5, 0.5, -2.0])
    margin = torch.tensor([0.0, 0.5, 1.0, 2.0])
    got = reward_model.bradley_terry_losses(chosen, rejected, margin=margin, center_rewards_coefficient=0.1)
    expected = [
        math.log1p(math.exp(-(c - r - m))) + 0.1 * (c + r) ** 2
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist())
    ]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    plain = reward_model.bradley_terry_losses(chosen, rejected)
    torch.testing.assert_close(plain, -torch.log(torch.sigmoid(chosen - rejected)))
    sums = reward_model.metric_sums(chosen, rejected)
    assert sums["accuracy"] == 2.0  # the tie (0.5, 0.5) is not a win
    assert sums["margin"] == pytest.approx(1.0 - 1.5 + 0.0 + 5.0)
    # a large negative difference stays finite (log-sigmoid, not log of a sigmoid that underflows)
    assert torch.isfinite(reward_model.bradley_terry_losses(torch.tensor([-200.0]), torch.tensor([200.0]))).all()


def test_collator_masks_padding_and_the_model_pools_each_rows_last_real_token(tokenizer, tiny_model_config):
    """Scores of pairs batched with right padding equal each pair's scores on its own."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    pairs_raw = Dataset.from_list(
        [
            {"prompt": "reverse: ab", "chosen": "ba", "rejected": "ab", "margin": 1.0},
            {"prompt": "reverse: abcdefg", "chosen": "gfedcba", "rejected": "gfedcab", "margin": 0.0},
        ]
    )
    pairs, _ = paired.tokenize_pairs(pairs_raw, tokenizer, max_length=48)
    pairs, has_margin = reward_model.add_margins(pairs, pairs_raw, name="train")
    assert has_margin
    collate = reward_model.RewardCollator(tokenizer.pad_token_id)
    batch = collate([pairs[0], pairs[1]])
    assert batch["margin"].tolist() == [1.0, 0.0]
    assert batch["attention_mask"].sum(1).tolist() == batch["real_tokens"].tolist()
    config = AutoConfig.from_pretrained(tiny_model_config)
    reward_model.configure(config, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        together = torch.cat(reward_model.rewards(model, batch))
        alone = [torch.cat(reward_model.rewards(model, collate([pair]))) for pair in (pairs[0], pairs[1])]
    torch.testing.assert_close(together, torch.stack([alone[0][0], alone[1][0], alone[0][1], alone[1][1]]))


def test_margins_must_be_finite_numbers():
    pairs = Dataset.from_dict({"index": [0, 1]})
    with pytest.raises(DataError, match="pair 1 of the train split: its 'margin' is nan"):
        reward_model.add_margins(pairs, Dataset.from_dict({"margin": [1.0, float("nan")]}), name="train")
    with pytest.raises(DataError, match="pair 0 of the eval split: its 'margin' is 'big'"):
        reward_model.add_margins(pairs, Dataset.from_dict({"margin": ["big", "1"]}), name="eval")
    added, present = reward_model.add_margins(pairs, Dataset.from_dict({"other": [1, 2]}), name="train")
    assert not present and added["margin"] == [0.0, 0.0]


def test_a_classifier_base_with_another_number_of_labels_is_refused_with_the_fix(tiny_model_config):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_config, num_labels=3)
    config.architectures = ["LlamaForSequenceClassification"]
    with pytest.raises(ConfigError, match="num_labels=3.*ignore_mismatched_sizes: true"):
        reward_model.check_head(config, ignore_mismatched_sizes=False, source="some/classifier")
    reward_model.check_head(config, ignore_mismatched_sizes=True, source="some/classifier")
    config.num_labels = 1
    reward_model.check_head(config, ignore_mismatched_sizes=False, source="some/reward-model")


# ------------------------------------------------------------------------------ errors before weights load, in-process
def _bad_input_values(tmp_path: Path, pretrained_tiny_model: Path, reward_pairs: Path, **overrides) -> dict:
    return reward_values(pretrained_tiny_model, reward_pairs, tmp_path / "out", **overrides)


def test_refuses_a_dataset_without_pairs(tmp_path, capsys, pretrained_tiny_model, reward_pairs):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "abc", "label": 1}] * 4)
    values = _bad_input_values(tmp_path, pretrained_tiny_model, tmp_path, eval_split_size=0.0)
    line = recipe_error_in_process("reward", tmp_path, values, capsys)
    assert "'prompt', 'chosen' and 'rejected'" in line
    assert not (tmp_path / "out").exists()


def test_refuses_a_margin_that_is_not_a_number(tmp_path, capsys, pretrained_tiny_model, reward_pairs):
    rows = [json.loads(line) for line in (reward_pairs / "train.jsonl").read_text().splitlines()]
    rows[3]["margin"] = "large"
    write_jsonl(tmp_path / "train.jsonl", rows)
    line = recipe_error_in_process(
        "reward", tmp_path, _bad_input_values(tmp_path, pretrained_tiny_model, tmp_path, eval_split_size=0.0), capsys
    )
    assert "pair 3 of the train split: its 'margin' is 'large'" in line


def test_refuses_a_negative_center_rewards_coefficient(tmp_path, capsys, pretrained_tiny_model, reward_pairs):
    values = _bad_input_values(tmp_path, pretrained_tiny_model, reward_pairs, center_rewards_coefficient=-1.0)
    assert "center_rewards_coefficient must be a finite number >= 0" in recipe_error_in_process(
        "reward", tmp_path, values, capsys
    )


def test_refuses_a_classifier_base_with_three_labels(tmp_path, capsys, pretrained_tiny_model, reward_pairs):
    """Only its config and tokenizer are needed: the refusal comes before any weights load (the folder has none)."""
    folder = tmp_path / "three_labels"
    folder.mkdir()
    config = json.loads((pretrained_tiny_model / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "a", "1": "b", "2": "c"})
    config["label2id"] = {"a": 0, "b": 1, "c": 2}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (TOKENIZER / name).exists():
            (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    line = recipe_error_in_process("reward", tmp_path, _bad_input_values(tmp_path, folder, reward_pairs), capsys)
    assert "num_labels=3" in line and "ignore_mismatched_sizes: true" in line


# -------------------------------------------------------------------------------------------------- the shared runs
@pytest.mark.slow
def test_two_ranks_equal_one_process(reward_distill_launches):
    """The loss is the mean over the global batch's pairs however they are split: 2 ranks x 4 pairs x 2 micro-steps
    and 1 process x 8 pairs x 2 give the same losses (float rounding apart) and the same accuracies."""
    two, one = reward_distill_launches["reward_two"], reward_distill_launches["reward_one"]
    records_two, records_one = step_records(two), step_records(one)
    assert sorted(records_two) == sorted(records_one) == list(range(1, REWARD_STEPS + 1))
    steps = sorted(records_two)

    def figures(records, name):
        return torch.tensor([records[s][name] for s in steps], dtype=torch.float64)

    torch.testing.assert_close(figures(records_two, "loss"), figures(records_one, "loss"), rtol=1e-5, atol=0)
    assert figures(records_two, "accuracy").tolist() == figures(records_one, "accuracy").tolist()
    for name in ("margin", "rewards/chosen", "rewards/rejected"):  # scores of size ~0.01-1: rounding, amplified by
        # training, moves them by ~1e-5
        torch.testing.assert_close(figures(records_two, name), figures(records_one, name), rtol=0, atol=1e-4)
    summary = json.loads((two / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"]["version"] == 2
    assert summary["parameter_placements"] == ["(Shard(dim=0),)"]  # the score head shards with the root unit
    assert summary["reward_head"] == ["score"] and summary["data"]["margin_column"] is True


FIGURES = ("loss", "grad_norm", "lr", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


@pytest.mark.slow
def test_an_interrupted_run_resumes_exactly(
    reward_distill_launches, tmp_path, pretrained_tiny_model, reward_pairs, monkeypatch
):
    """The 1-process run interrupted after step 5 (its last checkpoint: step 3) and resumed, in this process: it
    re-takes steps 4-5 (logging step 4 and its held-out figures a second time), and every step's figures and the
    final weights equal the uninterrupted run's (the shared 1-process run) bitwise."""
    whole = reward_distill_launches["reward_one"]
    values = reward_one_values(pretrained_tiny_model, reward_pairs, tmp_path / "stopped")
    monkeypatch.setenv(FAULT_ENV, "raise-after-step:5")
    with pytest.raises(InjectedFault):
        run_recipe_in_process("reward", tmp_path, "stopped", values)
    monkeypatch.delenv(FAULT_ENV)
    run_recipe_in_process("reward", tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    logged = read_metrics(tmp_path / "stopped")
    steps = [r["step"] for r in logged if "loss" in r]
    assert steps == [1, 2, 3, 4, 4, 5, 6, 7, 8]  # the stopped run's steps 1-4, then the resumed run's 4-8
    expected = step_records(whole)
    for record in (r for r in logged if "loss" in r):
        assert {name: record[name] for name in FIGURES} == {name: expected[record["step"]][name] for name in FIGURES}
    evals = [r for r in logged if "eval_loss" in r]  # every held-out figure, the records compared whole
    expected_evals = {r["step"]: r for r in read_metrics(whole) if "eval_loss" in r}
    assert [r["step"] for r in evals] == [4, 4, 8] and sorted(expected_evals) == [4, 8]
    assert all(record == expected_evals[record["step"]] for record in evals)
    for name, tensor in load_file(whole / "model.safetensors").items():
        assert torch.equal(tensor, load_file(tmp_path / "stopped" / "model.safetensors")[name]), name


@pytest.mark.slow
def test_exported_reward_model_scores_pairs_as_the_trained_model_did(reward_distill_launches, reward_pairs, tokenizer):
    """The run's held-out accuracy and margin (gathered over 2 ranks) equal those of the exported folder loaded with
    AutoModelForSequenceClassification on one process; pipeline("text-classification") gives its raw score."""
    from transformers import AutoModelForSequenceClassification, pipeline

    out = reward_distill_launches["reward_two"]
    results = json.loads((out / "eval_results.json").read_text())
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    raw = Dataset.from_list([json.loads(line) for line in (reward_pairs / "test.jsonl").read_text().splitlines()])
    pairs, _ = paired.tokenize_pairs(raw, tokenizer, max_length=48)
    pairs, _ = reward_model.add_margins(pairs, raw, name="eval")
    with torch.no_grad():
        chosen, rejected = reward_model.rewards(model, reward_model.RewardCollator(tokenizer.pad_token_id)(list(pairs)))
    assert results["eval_samples"] == len(raw)
    assert results["eval_accuracy"] == pytest.approx((chosen > rejected).float().mean().item(), abs=1e-9)
    assert results["eval_margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-5, abs=1e-6)
    text = tokenizer.decode(pairs[0]["chosen_input_ids"])
    (answer,) = pipeline("text-classification", model=str(out), device="cpu")([text])
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        direct = model(**ids).logits[0, 0].item()
    assert answer["label"] == "reward" and answer["score"] == pytest.approx(direct, rel=1e-5)
    card = (out / "README.md").read_text()
    assert "ids = tokenizer(prompt + answer + tokenizer.eos_token" in card  # how to score as trained
    meta = yaml.safe_load(card.split("---")[1])
    entries = meta["model-index"][0]["results"]
    values = {metric["type"]: metric["value"] for entry in entries for metric in entry["metrics"]}
    assert values["accuracy"] == results["eval_accuracy"] and values["margin"] == results["eval_margin"]


def test_the_demo_sets_made_from_the_reversal_data_rebuild_and_hold_out_the_right_data(tmp_path, monkeypatch):
    """demo/assets/reverse_reward (the reward demo's 32,000 pairs) and reverse_cut (the distillation demo's answers,
    some cut short) rebuild byte for byte, the DPO set beside them is unchanged, and the DPO and reward sets hold out
    the same 200 pairs, so the two demos' held-out figures compare."""
    import importlib.util
    import sys

    from fsdp_recipes.data import files

    assets = REPO / "demo" / "assets"
    spec = importlib.util.spec_from_file_location("make_preference_assets", REPO / "demo" / "make_preference_assets.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    argv = ["make_preference_assets.py", "--out-dir", str(tmp_path / "dpo"), "--reward-out-dir", str(tmp_path / "rw")]
    monkeypatch.setattr(sys, "argv", argv + ["--cut-out-dir", str(tmp_path / "cut")])
    generator.main()
    for rebuilt, shipped in (("dpo", "reverse_preferences"), ("rw", "reverse_reward"), ("cut", "reverse_cut")):
        names = sorted(path.name for path in (assets / shipped).iterdir())
        assert sorted(path.name for path in (tmp_path / rebuilt).iterdir()) == names
        for name in names:
            assert (tmp_path / rebuilt / name).read_bytes() == (assets / shipped / name).read_bytes(), name
    assert (assets / "reverse_reward" / "test.jsonl").read_bytes() == (
        assets / "reverse_preferences" / "test.jsonl"
    ).read_bytes()

    # the distillation demo's data: the SFT demo's prompts in order, 60% of answers over 6 letters cut to their first
    # 6 (every other answer whole), the test split whole
    whole, cut = (files.load_raw_dataset(str(assets / name)) for name in ("reverse", "reverse_cut"))
    assert cut["test"]["messages"] == whole["test"]["messages"]
    pairs_of_answers = [
        (w[1]["content"], c[1]["content"]) for w, c in zip(whole["train"]["messages"], cut["train"]["messages"])
    ]
    assert [c[0] for c in cut["train"]["messages"]] == [w[0] for w in whole["train"]["messages"]]
    shortened = [len(full) > 6 and short == full[:6] for full, short in pairs_of_answers]
    assert all(short == full for (full, short), was_cut in zip(pairs_of_answers, shortened) if not was_cut)
    assert sum(shortened) == 793 and 0.55 < 793 / sum(len(full) > 6 for full, _ in pairs_of_answers) < 0.65

    pairs = files.load_raw_dataset(str(assets / "reverse_reward"))
    assert (len(pairs["train"]), len(pairs["test"])) == (32000, 200)
    for pair in pairs["train"].select(range(0, 32000, 97)):
        prompt, chosen = pair["prompt"][0]["content"], pair["chosen"][0]["content"]
        assert chosen == prompt.removeprefix("reverse: ")[::-1] != pair["rejected"][0]["content"]
