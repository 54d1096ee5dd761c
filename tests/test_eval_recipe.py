"""recipes/eval.py: two real 2-process FSDP2 launches (a causal LM: perplexity and generation metrics; the classify
run's checkpoint: classification metrics), each compared with the same evaluation on one process, here; metrics
loading, model sources, the card's model-index and every error raised before weights load, in this process."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from fixtures.classify import CLASSIFY_STEPS, CLASSIFY_TEST_ROWS
from fsdp_recipes.common.arguments import parse_config
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.publish import model_index, model_source
from fsdp_recipes.train import evaluation, generation, generation_metrics
from helpers.data import write_jsonl, write_tiny_model_config
from helpers.launch import alongside, launch, require_success
from helpers.paths import DEMO_DATA, EVAL
from helpers.recipes import load_recipe, recipe_config, run_recipe_in_process

GENERATION_ROWS = 13  # 2 ranks x 4 prompts per batch: the last global batch holds 5, padded with 3 copies


def run_in_process(tmp: Path, name: str, values: dict) -> None:
    run_recipe_in_process("eval", tmp, name, values)


def run_failing(tmp: Path, values: dict, capsys) -> tuple[str, str]:
    """Returns (the one `error:` line, all of stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(tmp, "failing", values)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0], stderr


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, tokenizer) -> Path:
    """A randomly initialised causal LM saved as a model folder, with the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_lm")
    write_tiny_model_config(folder / "config.json", tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_eval_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat_eval")
    (folder / "test.jsonl").write_text(
        "\n".join((DEMO_DATA / "test.jsonl").read_text().splitlines()[:GENERATION_ROWS]) + "\n"
    )
    return folder


def lm_values(model: Path, data: Path, output_dir: Path, **overrides) -> dict:
    values = dict(
        model_name_or_path=str(model),
        dataset_name=str(data),
        output_dir=str(output_dir),
        max_length=64,
        per_device_eval_batch_size=4,
        max_new_tokens=6,
        metrics=["perplexity", "exact_match", "rouge", "sacrebleu", "chrf"],
    )
    values.update(overrides)
    return values


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory, tiny_lm, chat_eval_data) -> tuple[Path, Path]:
    """(1 process, here; 2 processes under FSDP2) evaluations of the same causal LM on the same chat data."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    config = recipe_config(tmp / "two.yaml", **lm_values(tiny_lm, chat_eval_data, tmp / "two"))
    alongside(
        lambda: run_in_process(tmp, "one", lm_values(tiny_lm, chat_eval_data, tmp / "one")),
        lambda: require_success(launch(EVAL, ["--config", str(config)])),
    )
    return tmp / "one", tmp / "two"


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory, classify_run, classify_data) -> tuple[Path, Path]:
    """(1 process, here, on a copy of the exported folder, results written into it; 2 processes under FSDP2 on the
    run's last checkpoint, exported to a temporary folder first) evaluations of the classify run's model."""
    tmp = tmp_path_factory.mktemp("classifier_eval")
    copy = shutil.copytree(classify_run, tmp / "exported", ignore=shutil.ignore_patterns("checkpoints"))
    common = dict(dataset_name=str(classify_data), max_length=32, per_device_eval_batch_size=8)
    checkpoint = classify_run / "checkpoints" / f"step-{CLASSIFY_STEPS:08d}"
    config = recipe_config(tmp / "two.yaml", model_name_or_path=str(checkpoint), output_dir=str(tmp / "two"), **common)
    alongside(
        lambda: run_in_process(tmp, "one", dict(model_name_or_path=str(copy), **common)),
        lambda: require_success(launch(EVAL, ["--config", str(config)])),
    )
    return copy, tmp / "two"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------ 1 process against 2 under FSDP2
@pytest.mark.slow
def test_perplexity_on_one_and_two_ranks_agree(lm_runs):
    one, two = (json.loads((folder / "eval_results.json").read_text()) for folder in lm_runs)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)
    assert two["eval_perplexity"] == pytest.approx(one["eval_perplexity"], rel=1e-6)
    assert one["eval_perplexity"] == pytest.approx(math.exp(one["eval_loss"]))


@pytest.mark.slow
def test_generations_and_their_metrics_are_identical_on_one_and_two_ranks(lm_runs):
    one, two = lm_runs
    predictions = [read_jsonl(folder / "eval_predictions.jsonl") for folder in lm_runs]
    assert len(predictions[0]) == GENERATION_ROWS  # each prompt once, the padding copies dropped
    assert predictions[0] == predictions[1]
    references = [
        json.loads(line)["messages"][-1]["content"]
        for line in (DEMO_DATA / "test.jsonl").read_text().splitlines()[:GENERATION_ROWS]
    ]
    assert [p["reference"] for p in predictions[0]] == references  # dataset order
    results = [json.loads((folder / "eval_results.json").read_text()) for folder in lm_runs]
    for key in ("eval_exact_match", "eval_rouge1", "eval_rougeL", "eval_sacrebleu", "eval_chrf", "eval_samples"):
        assert results[0][key] == results[1][key], key
    assert results[1]["eval_samples"] == GENERATION_ROWS


@pytest.mark.slow
def test_results_land_in_eval_results_json_and_the_card(lm_runs, chat_eval_data):
    folder = lm_runs[1]
    results = json.loads((folder / "eval_results.json").read_text())
    assert results["split"] == "test" and results["dataset"] == str(chat_eval_data)
    card = (folder / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["pipeline_tag"] == "text-generation"
    (entry,) = meta["model-index"][0]["results"]
    assert entry["task"]["type"] == "text-generation" and entry["dataset"]["split"] == "test"
    values = {metric["name"]: metric["value"] for metric in entry["metrics"]}
    assert values["Perplexity"] == results["eval_perplexity"] and values["chrF"] == results["eval_chrf"]
    assert values["ROUGE-L"] == results["eval_rougeL"] and values["Exact match"] == results["eval_exact_match"]
    assert "| Perplexity |" in card


@pytest.mark.slow
def test_a_checkpoint_on_two_ranks_scores_as_the_training_run_and_one_process(checkpoint_runs, classify_run):
    in_place, two = checkpoint_runs
    training = json.loads((classify_run / "eval_results.json").read_text())
    for folder in (in_place, two):
        results = json.loads((folder / "eval_results.json").read_text())
        assert results["eval_samples"] == CLASSIFY_TEST_ROWS
        for key in ("eval_accuracy", "eval_f1", "eval_f1_per_class"):
            assert results[key] == training[key], (folder, key)
        assert results["eval_loss"] == pytest.approx(training["eval_loss"], rel=1e-6)
    predictions = [read_jsonl(folder / "eval_predictions.jsonl") for folder in checkpoint_runs]
    assert predictions[0] == predictions[1] and len(predictions[0]) == CLASSIFY_TEST_ROWS
    assert {p["prediction"] for p in predictions[0]} <= {"high", "low", "mid"}  # label names, not ids


@pytest.mark.slow
def test_evaluating_a_model_folder_in_place_updates_its_own_card(checkpoint_runs):
    card = (checkpoint_runs[0] / "README.md").read_text()
    assert "Fine-tuned with the FSDP Recipes `classify` recipe" in card  # the training card, kept
    meta = yaml.safe_load(card.split("---")[1])
    (entry,) = meta["model-index"][0]["results"]  # the same dataset, split and metrics: replaced, not repeated
    assert sorted(m["type"] for m in entry["metrics"]) == ["accuracy", "f1", "loss"]
    assert card.count("<!-- fsdp-recipes:evaluation -->") == 1


def test_plain_text_perplexity_equals_the_models_own_loss(tmp_path, tiny_lm, tokenizer):
    """Plain text: every token after the first is a target; the recipe's mean equals the token-weighted mean of
    transformers' own loss over each text."""
    import torch
    from transformers import AutoModelForCausalLM

    texts = ["hello world", "abc", "the quick brown fox jumps"]
    write_jsonl(tmp_path / "test.jsonl", [{"text": text} for text in texts])
    run_in_process(
        tmp_path,
        "text",
        lm_values(tiny_lm, tmp_path / "test.jsonl", tmp_path / "out", metrics=["perplexity"], dataset_split="train"),
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    total = count = 0.0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert not (tmp_path / "out" / "eval_predictions.jsonl").exists()  # no generation was asked for


def test_a_one_split_dataset_is_evaluated_on_its_split_and_the_tracker_gets_the_results(tmp_path, tiny_lm, capsys):
    """A single data file loads as one split ('train'): evaluated on it, not refused for lacking 'test'. report_to, a
    flag every recipe takes, writes the results to the tracker in output_dir too."""
    write_jsonl(tmp_path / "texts.jsonl", [{"text": "hello world"}, {"text": "the quick brown fox"}])
    run_in_process(
        tmp_path,
        "one_split",
        lm_values(tiny_lm, tmp_path / "texts.jsonl", tmp_path / "out", metrics=["perplexity"], report_to="tensorboard"),
    )
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["split"] == "train" and math.isfinite(results["eval_loss"])
    assert "the dataset has one split, 'train', and no 'test': evaluating on it" in capsys.readouterr().out
    assert list((tmp_path / "out").rglob("events.out.tfevents.*")), "the tracker wrote nothing"


# ---------------------------------------------------------------------- errors before any weights load, in this process
def test_a_metric_that_cannot_be_loaded_offline_is_one_error_before_loading(tmp_path, tiny_lm, chat_eval_data, capsys):
    values = lm_values(tiny_lm, chat_eval_data, tmp_path / "out", metrics=["perplexity", "bleu", "rouge"])
    error, stderr = run_failing(tmp_path, values, capsys)
    assert "metric 'bleu' cannot be loaded" in error and "for BLEU use sacrebleu" in error
    assert "Shipped, loaded without network: accuracy, chrf, exact_match" in error
    assert "Loading weights" not in stderr and not (tmp_path / "out").exists()


def test_a_misspelled_metric_gets_the_name_it_is_closest_to_among_those_that_apply(
    tmp_path, tokenizer, tiny_lm, chat_eval_data, capsys
):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    classifier, labels = tmp_path / "classifier", tmp_path / "labels"
    classifier.mkdir()
    labels.mkdir()
    write_tiny_model_config(
        classifier / "config.json",
        tokenizer,
        architectures=["LlamaForSequenceClassification"],
        id2label={0: "no", 1: "yes"},
        label2id={"no": 0, "yes": 1},
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(classifier)).save_pretrained(classifier)
    tokenizer.save_pretrained(classifier)
    write_jsonl(labels / "test.jsonl", [{"text": "abc", "label": "yes"}, {"text": "xyz", "label": "no"}])
    values = dict(
        model_name_or_path=str(classifier),
        dataset_name=str(labels),
        max_length=16,
        output_dir=str(tmp_path / "out"),
        metrics=["acuracy"],
    )
    error, stderr = run_failing(tmp_path, values, capsys)
    assert error.startswith("error: metric 'acuracy' cannot be loaded: did you mean 'accuracy'? (")
    assert "Loading weights" not in stderr and not (tmp_path / "out").exists()
    # a causal LM is offered its own names (perplexity is one), never a classifier's
    misspelled = lm_values(tiny_lm, chat_eval_data, tmp_path / "out", metrics=["perplexty"])
    error, _ = run_failing(tmp_path, misspelled, capsys)
    assert "metric 'perplexty' cannot be loaded: did you mean 'perplexity'?" in error
    error, _ = run_failing(tmp_path, lm_values(tiny_lm, chat_eval_data, tmp_path / "out", metrics=["acuracy"]), capsys)
    assert "metric 'acuracy' cannot be loaded (" in error and "did you mean" not in error


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(metrics=["perplexity", "accuracy"]), "metrics ['accuracy'] do not apply to a causal-lm model"),
        (
            dict(model_name_or_path="someone/some-model", output_dir=None),
            "output_dir is required when evaluating a Hub id",
        ),
        (
            dict(model_name_or_path="{tmp}"),
            "is neither a model folder (no config.json) nor a complete recipe checkpoint",
        ),
    ],
)
def test_bad_requests_are_one_error_before_loading(tmp_path, tiny_lm, chat_eval_data, capsys, overrides, expected):
    values = lm_values(tiny_lm, chat_eval_data, tmp_path / "out")
    values.update(
        {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in overrides.items()}
    )
    error, stderr = run_failing(tmp_path, values, capsys)
    assert expected in error and "Loading weights" not in stderr


def test_a_metric_list_must_be_a_list(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("model_name_or_path: m\ndataset_name: d\nmetrics: rouge\n")
    with pytest.raises(ConfigError, match=r"metrics in config file .*expected a list, e.g. \['rouge'\]"):
        parse_config(load_recipe("eval").EvalConfig, ["--config", str(path)])


# ------------------------------------------------------------------------------------ metrics, sources, model-index
def test_shipped_metrics_load_without_network_and_compute_as_their_libraries(monkeypatch):
    from sklearn.metrics import f1_score

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metrics = evaluation.load_metrics(["accuracy", "f1"])
    gathered = {"predictions": [0, 2, 1, 1, 0], "references": [0, 1, 1, 2, 0], "loss": [0.5, 1.0, 1.5, 2.0, 1.0]}
    results = evaluation.compute_metrics(metrics, gathered)
    assert results == {
        "eval_accuracy": 0.6,
        "eval_f1": f1_score([0, 1, 1, 2, 0], [0, 2, 1, 1, 0], average="macro"),
        "eval_loss": 1.2,
        "eval_samples": 5,
    }
    generated = evaluation.load_metrics(["exact_match"])
    text = evaluation.compute_metrics(generated, {"predictions": [" ab ", "a"], "references": ["ab", "b"]})
    assert text["eval_exact_match"] == 0.5  # surrounding whitespace is not a difference


def test_model_sources(tmp_path, tiny_lm):
    assert model_source.resolve(str(tiny_lm)).kind == "folder"
    assert model_source.resolve("org/model").kind == "hub"
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000003"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="nor a complete recipe checkpoint"):  # killed while saving: no progress.json
        model_source.resolve(str(checkpoint))
    (checkpoint / "progress.json").write_text("{}")
    source = model_source.resolve(str(checkpoint))
    assert source.kind == "checkpoint" and source.files == str(checkpoint / "model")
    (checkpoint.parent / "latest").write_text(checkpoint.name + "\n")
    with pytest.raises(ConfigError, match="evaluate .*step-00000003"):
        model_source.resolve(str(tmp_path / "out"))


def test_update_card_merges_results_by_dataset_split_and_metric(tmp_path):
    def results(split, accuracy):
        return model_index.eval_results(
            {"eval_accuracy": accuracy, "eval_samples": 9, "eval_f1_per_class": {"a": 1}},
            task="text-classification",
            dataset="org/data",
            split=split,
        )

    model_index.update_card(tmp_path, results("test", 0.5), model_name="m", pipeline_tag="text-classification")
    model_index.update_card(tmp_path, results("validation", 0.7), model_name="m", pipeline_tag="text-classification")
    model_index.update_card(tmp_path, results("test", 0.9), model_name="m", pipeline_tag="text-classification")
    meta = yaml.safe_load((tmp_path / "README.md").read_text().split("---")[1])
    entries = {entry["dataset"]["split"]: entry["metrics"] for entry in meta["model-index"][0]["results"]}
    assert entries == {
        "validation": [{"type": "accuracy", "value": 0.7, "name": "Accuracy"}],
        "test": [{"type": "accuracy", "value": 0.9, "name": "Accuracy"}],
    }
    assert meta["model-index"][0]["name"] == "m" and entries["test"][0]["value"] == 0.9


def test_a_sampled_completion_does_not_depend_on_its_batch(tiny_lm, tokenizer):
    """What makes sampling identical on 1 and N ranks: N ranks see other batch neighbours (and padding) than 1."""
    from transformers import AutoModelForCausalLM

    examples = [
        {"prompt_ids": tokenizer(text)["input_ids"], "reference": "", "index": index}
        for index, text in enumerate(["reverse: abc", "reverse: qwertyu", "x"])
    ]
    collate = generation_metrics.GenerationCollator(tokenizer)
    settings = generation.GenerationSettings(8, seed=5)
    predict = generation_metrics.generation_predict(tokenizer, settings=settings, do_sample=True, synced_gpus=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    alone = predict(model, collate(examples[:1]))["predictions"]
    together = predict(model, collate(examples))["predictions"]
    assert together[0] == alone[0]
    greedy = generation_metrics.generation_predict(tokenizer, settings=settings, do_sample=False, synced_gpus=False)
    assert greedy(model, collate(examples))["predictions"] != together  # it does sample
    paged = generation_metrics.generation_predict(
        tokenizer, settings=dataclasses.replace(settings, backend="paged"), do_sample=True, synced_gpus=False
    )
    assert paged(model, collate(examples))["predictions"] == together  # any backend: the same predictions


def test_a_checkpoint_of_a_run_without_fsdp_exports_too(tmp_path, tokenizer):
    """`python recipes/classify.py` without a launcher saves plain `model.safetensors` in its checkpoints."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fsdp_recipes.publish.checkpoint_export import export_checkpoint
    from fsdp_recipes.train.checkpoint import write_model_files

    config = AutoConfig.from_pretrained(write_tiny_model_config(tmp_path / "config.json", tokenizer), num_labels=3)
    model = AutoModelForSequenceClassification.from_config(config)
    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    write_model_files(
        checkpoint / "model",
        model_config=config,
        generation_config=None,
        tokenizer=tokenizer,
        recipe_config={},
        accelerate_config={},
        run_info={"recipe": "classify", "task": "sequence-classification"},
    )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint / "model.safetensors")
    (checkpoint / "progress.json").write_text(
        json.dumps(
            dict(
                step=2,
                epoch=0,
                batches_into_epoch=2,
                world_size=1,
                per_device_train_batch_size=4,
                gradient_accumulation_steps=1,
            )
        )
    )
    source = model_source.resolve(str(checkpoint))
    assert model_source.task_of(source, config) == "sequence-classification"
    folder = export_checkpoint(checkpoint, tmp_path / "exported")
    exported = load_file(folder / "model.safetensors")
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
