"""recipes/classify.py: one real 2-process FSDP2 launch (the session fixture `classify_run`, shared with the eval
recipe's tests) shows learning, sharding, metrics over ranks without duplicates, and the exported folder; the data,
the loss and every error raised before weights load are checked in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from datasets import ClassLabel, Dataset, Features

from fixtures.classify import CLASSIFY_STEPS, CLASSIFY_TEST_ROWS, classify_values
from fsdp_recipes.common.arguments import parse_config
from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.methods.classify import classification, classifier
from fsdp_recipes.train import losses
from helpers.data import write_jsonl, write_tiny_model_config
from helpers.recipes import load_recipe, read_metrics, recipe_config, recipe_error_in_process


# ------------------------------------------------------------------------------------------ the 2-rank FSDP2 launch
@pytest.mark.slow
def test_learns_under_two_rank_fsdp2_with_the_head_sharded(classify_run):
    summary = json.loads((classify_run / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"]["version"] == 2
    assert summary["parameter_placements"] == ["(Shard(dim=0),)"]  # the score head too: it shards with the root
    assert summary["classifier_head"] == ["score"] and summary["labels"] == ["high", "low", "mid"]
    records = read_metrics(classify_run)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [20, CLASSIFY_STEPS]
    assert all(r["eval_samples"] == CLASSIFY_TEST_ROWS for r in evals)  # each held-out row once, not 48
    results = json.loads((classify_run / "eval_results.json").read_text())
    assert results["eval_accuracy"] > 0.6  # chance is 1/3
    train = [r["loss"] for r in records if "loss" in r]
    assert train[-1] < train[0]


@pytest.mark.slow
def test_exported_folder_predicts_through_pipeline_and_the_metrics_match_one_process(classify_run, classify_data):
    """The run's metrics, gathered over 2 ranks with an uneven last batch, equal those of the exported model's
    pipeline predictions computed here on one process with scikit-learn."""
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import pipeline

    rows = [json.loads(line) for line in (classify_data / "test.jsonl").read_text().splitlines()]
    classify = pipeline("text-classification", model=str(classify_run), device="cpu")
    predicted = [answer["label"] for answer in classify([row["text"] for row in rows], batch_size=8)]
    references = [row["label"] for row in rows]
    results = json.loads((classify_run / "eval_results.json").read_text())
    assert results["eval_samples"] == len(rows)
    assert results["eval_accuracy"] == accuracy_score(references, predicted)
    assert results["eval_f1"] == f1_score(references, predicted, average="macro")
    per_class = f1_score(references, predicted, average=None, labels=["high", "low", "mid"])
    assert results["eval_f1_per_class"] == dict(zip(["high", "low", "mid"], per_class.tolist()))


@pytest.mark.slow
def test_config_and_card_of_the_exported_folder(classify_run, tokenizer):
    config = json.loads((classify_run / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["id2label"] == {"0": "high", "1": "low", "2": "mid"}
    assert config["pad_token_id"] == tokenizer.pad_token_id  # pooling finds the last real token with it
    card = (classify_run / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["pipeline_tag"] == "text-classification"
    (entry,) = meta["model-index"][0]["results"]
    assert entry["task"]["type"] == "text-classification" and entry["dataset"]["split"] == "test"
    values = {metric["type"]: metric["value"] for metric in entry["metrics"]}
    results = json.loads((classify_run / "eval_results.json").read_text())
    assert values["accuracy"] == results["eval_accuracy"] and values["f1"] == results["eval_f1"]
    assert "<!-- fsdp-recipes:evaluation -->" in card and "F1 (macro)" in card


# --------------------------------------------------------------------------------------------- data, in this process
def test_label_names_and_ids_from_each_label_kind():
    strings = Dataset.from_dict({"label": ["pos", "neg", "pos"]})
    assert classification.label_names(strings, "label") == ["neg", "pos"]
    integers = Dataset.from_dict({"label": [10, 2, 2]})
    assert classification.label_names(integers, "label") == ["2", "10"]  # numeric order, not text order
    assert classification.label_ids(integers, "label", {"2": 0, "10": 1}, name="train") == [1, 0, 0]
    features = Features({"label": ClassLabel(names=["neg", "neu", "pos"])})
    declared = Dataset.from_dict({"label": [2, 0]}, features=features)
    assert classification.label_names(declared, "label") == ["neg", "neu", "pos"]  # declared classes kept
    assert classification.label_ids(declared, "label", {"neg": 0, "neu": 1, "pos": 2}, name="eval") == [2, 0]
    assert classification.label_ids(strings, "label", {"NEG": 0, "POS": 1}, name="eval") == [1, 0, 1]
    unlabelled = Dataset.from_dict({"label": [0, -1]}, features=features)  # GLUE-style test split
    with pytest.raises(DataError, match="1 rows have no label"):
        classification.label_ids(unlabelled, "label", {"neg": 0, "neu": 1, "pos": 2}, name="eval")


def test_integer_labels_are_ids_only_for_a_model_without_label_names():
    data = Dataset.from_dict({"label": [1, 0]})
    assert classification.label_ids(data, "label", {"LABEL_0": 0, "LABEL_1": 1}, name="eval", ids_allowed=True) == [
        1,
        0,
    ]
    with pytest.raises(DataError, match="labels the classifier does not know: '0', '1'"):
        classification.label_ids(data, "label", {"LABEL_0": 0, "LABEL_1": 1}, name="eval")


def test_text_pairs_are_joined_by_the_tokenizer_and_truncated(tokenizer):
    data = Dataset.from_dict({"q": ["abc", "abcdefghij"], "a": ["de", "xyz"]})
    rows, stats = classification.tokenize(
        data, tokenizer, text_column="q", text_pair_column="a", labels=[1, 0], max_length=8
    )
    assert rows[0]["input_ids"] == tokenizer("abc", "de")["input_ids"] and rows[0]["labels"] == 1
    assert len(rows[1]["input_ids"]) == 8 and stats["truncated"] == 1
    batch = classification.collate([rows[0], rows[1]], pad_token_id=0)
    assert batch["attention_mask"].tolist()[0] == [1] * 5 + [0] * 3
    assert batch["input_ids"][0, 5:].tolist() == [0, 0, 0] and batch["real_tokens"].tolist() == [5, 8]


def test_balanced_class_weights_by_hand():
    weights = classification.class_weights([0, 0, 0, 1], num_labels=3, spec="balanced")
    # n / (present classes x n_class): 4 / (2 x 3) and 4 / (2 x 1); class 2 never occurs in training
    torch.testing.assert_close(weights, torch.tensor([4 / 6, 2.0, 0.0]))
    torch.testing.assert_close(classification.class_weights([0, 1], 2, "1,3.5"), torch.tensor([1.0, 3.5]))
    with pytest.raises(DataError, match="gives 3 weights but the data has 2 classes"):
        classification.class_weights([0, 1], 2, "1,2,3")


TWO_RANKS = ParallelDims(dp_shard=2)  # two data-parallel ranks, each its own batch


def test_weighted_loss_is_the_global_mean_whatever_the_split():
    """Each rank's summed loss times global_mean_scale, averaged over ranks (as FSDP averages gradients), is the
    weighted mean of the whole batch: sum(w[y] ce) / sum(w[y])."""

    class Logits(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": input_ids.float()})

    model, weights = Logits(), torch.tensor([1.0, 3.0])
    inputs = torch.tensor([[2.0, 0.5], [0.1, 0.3], [1.0, -1.0], [0.0, 2.0], [0.2, 0.1]])
    labels = torch.tensor([1, 0, 1, 1, 0])
    ce = torch.nn.functional.cross_entropy(inputs, labels, reduction="none")
    expected = float((weights[labels] * ce).sum() / weights[labels].sum())
    halves = [
        dict(input_ids=inputs[:2], attention_mask=None, labels=labels[:2]),
        dict(input_ids=inputs[2:], attention_mask=None, labels=labels[2:]),
    ]
    total = sum(classifier.weight_sum(batch, weights) for batch in halves)
    scale = losses.global_mean_scale(TWO_RANKS, total)
    averaged = sum(float(classifier.loss_sum(model, batch, weights)) * float(scale) for batch in halves) / 2
    assert averaged == pytest.approx(expected, rel=1e-6)
    assert float(losses.global_mean_scale(TWO_RANKS, torch.tensor(0.0))) == 0.0
    assert float(losses.global_mean_scale(TWO_RANKS, torch.tensor(0.5))) == 4.0  # class weights can sum below 1


def test_class_weights_and_columns_are_validated_with_the_config(tmp_path):
    config_class = load_recipe("classify").ClassifyConfig
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\ndataset_name: d\nclass_weights: heavy\ntext_pair_column: text\n")
    with pytest.raises(ConfigError) as error:
        parse_config(config_class, ["--config", str(path)])
    assert "class_weights 'heavy'" in str(error.value) and "text_pair_column must differ" in str(error.value)


# ------------------------------------------------------------------------ errors before weights load, in this process
def run_classify_failing(tmp: Path, values: dict, capsys) -> str:
    error = recipe_error_in_process("classify", tmp, values, capsys)
    assert not Path(values["output_dir"]).exists()  # refused before anything was written
    return error


def data_folder(tmp: Path, train: list[dict], test: list[dict]) -> Path:
    folder = tmp / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    return folder


ROWS = [{"text": "abc", "label": "x"}, {"text": "bcd", "label": "y"}]


@pytest.mark.parametrize(
    "case, train, test, expected",
    [
        (
            "label column missing",
            [{"text": "abc", "category": "x"}] * 4,
            [{"text": "abc", "category": "y"}],
            "no 'label': set text_column, text_pair_column and label_column",
        ),
        ("one label only", [{"text": "abc", "label": "x"}] * 4, ROWS, "a single label ('x' in column 'label')"),
        (
            "eval labels unseen in train",
            ROWS * 2,
            ROWS + [{"text": "q", "label": "z"}],
            "the eval split has labels the classifier does not know: 'z'",
        ),
    ],
)
def test_bad_data_is_one_error_before_loading(tmp_path, tiny_model_config, capsys, case, train, test, expected):
    values = classify_values(tiny_model_config, data_folder(tmp_path, train, test), tmp_path / "out")
    assert expected in run_classify_failing(tmp_path, values, capsys)


def test_no_held_out_data_and_mismatched_class_weights(tmp_path, tiny_model_config, capsys):
    only_train = tmp_path / "train.jsonl"
    write_jsonl(only_train, ROWS * 2)
    values = classify_values(tiny_model_config, only_train, tmp_path / "out", eval_split_size=0)
    assert "classification needs held-out data" in run_classify_failing(tmp_path, values, capsys)
    values = classify_values(
        tiny_model_config, data_folder(tmp_path, ROWS * 2, ROWS), tmp_path / "out", class_weights="1,2,3"
    )
    assert "gives 3 weights but the data has 2 classes" in run_classify_failing(tmp_path, values, capsys)


def test_resume_on_other_classes_is_refused(tmp_path, tokenizer, capsys):
    """The checkpoint's head has 3 rows (other classes): the shape check leaves the head to the recipe, which
    compares the classes once the data is read."""
    model_config = write_tiny_model_config(tmp_path / "model.json", tokenizer)
    values = classify_values(
        model_config,
        data_folder(tmp_path, ROWS * 2, ROWS),
        tmp_path / "out",
        resume_from_checkpoint="latest",
        save_steps=2,
    )
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000002"
    (checkpoint / "model").mkdir(parents=True)
    saved = json.loads(model_config.read_text())
    saved.update(id2label={"0": "x", "1": "y", "2": "w"}, label2id={"x": 0, "y": 1, "w": 2})
    (checkpoint / "model" / "config.json").write_text(json.dumps(saved))
    (checkpoint / "progress.json").write_text(
        json.dumps(
            dict(
                step=2,
                epoch=0,
                batches_into_epoch=1,
                world_size=1,
                per_device_train_batch_size=8,
                gradient_accumulation_steps=1,
            )
        )
    )
    (checkpoint.parent / "latest").write_text(checkpoint.name + "\n")
    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.errors import exit_on_user_error

    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(SystemExit):
        exit_on_user_error(
            lambda: load_recipe("classify").main(["--config", str(recipe_config(tmp_path / "r.yaml", **values))])
        )
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error == [
        "error: the checkpoint was trained on the classes ['x', 'y', 'w'] but this data gives ['x', 'y']: "
        "resume with the data it was trained on, or start a new run in another output_dir"
    ]
