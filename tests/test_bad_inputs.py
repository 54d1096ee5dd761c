"""A table of bad inputs for every recipe (docs/errors.md): each is refused before any weights load with exit status
2, one `error:` line that names the input, no traceback, and nothing existing changed or written (an output_dir with
someone's file in it keeps it; data and checkpoints are left as they were).

In this process, offline (a Hub id fails at once): the checks before loading need no processes, so each case costs a
fraction of a second. That such an error stops every rank of a real launch: tests/test_all_ranks_stop.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import huggingface_hub.constants
import pytest

from fixtures.classify import classify_values
from fixtures.dpo import dpo_values
from helpers.data import write_jsonl as _write_jsonl
from helpers.paths import REPO, TOKENIZER
from helpers.recipes import base_recipe_values, load_recipe, recipe_error_in_process

MISSING_MODEL = "outputs/demo_reverse/latest"  # what the DPO demo reads: a relative folder that may not exist yet
TURNS = [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]
CONFIG_CLASSES = {"sft": "SFTConfig", "dpo": "DPOConfig", "pretrain": "PretrainConfig", "classify": "ClassifyConfig"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture
def given(tmp_path, monkeypatch, tiny_model_config, tokenizer) -> SimpleNamespace:
    monkeypatch.chdir(tmp_path)  # relative paths in the cases are relative to the test's own folder
    return SimpleNamespace(tmp=tmp_path, model_config=tiny_model_config, tokenizer=tokenizer)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != "recipe.yaml"
    }


def assert_refused(recipe: str, given, values: dict, capsys, expected: list[str]) -> None:
    """The recipe's main, as `python recipes/<recipe>.py` runs it: one error line holding every `expected` part, and
    nothing under the test's folder changed or added."""
    out = Path(values["output_dir"])
    if not out.exists():  # someone's folder, which the run was allowed to write into
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("someone's notes")
        if recipe != "eval":
            values.setdefault("overwrite_output_dir", True)
    before = snapshot(given.tmp)
    error = recipe_error_in_process(recipe, given.tmp, values, capsys)
    for part in expected:
        assert part in error, error
    assert snapshot(given.tmp) == before


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_jsonl(path, records)


def binary_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(128, 256)) * 8)
    return path


def fake_checkpoint(recipe: str, values: dict, *, model_config: Path, **saved_changes) -> None:
    """What the checks before loading read of a checkpoint in output_dir: progress, the model's config and the recipe
    config it was trained with (`values` but for `saved_changes`)."""
    out = Path(values["output_dir"])
    folder = out / "checkpoints" / "step-00000004"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(model_config.read_text())
    config_class = getattr(load_recipe(recipe), CONFIG_CLASSES[recipe])
    saved = config_class(**{**values, "resume_from_checkpoint": None, **saved_changes})
    (folder / "model" / "recipe_config.json").write_text(json.dumps(saved.__dict__, default=str))
    (folder / "progress.json").write_text(
        json.dumps(
            dict(
                step=4,
                epoch=0,
                batches_into_epoch=4,
                world_size=1,
                per_device_train_batch_size=values.get("per_device_train_batch_size", 8),
                gradient_accumulation_steps=values.get("gradient_accumulation_steps", 1),
            )
        )
    )
    (out / "checkpoints" / "latest").write_text(folder.name + "\n")
    values["resume_from_checkpoint"] = "latest"


def few_chats(given, count: int) -> str:
    return str(write_jsonl(given.tmp / "few" / "train.jsonl", [{"messages": TURNS}] * count))


# ------------------------------------------------------------------------------------------------------------ sft
def sft_model_path_missing(given, values):
    values.update(model_config=None, tokenizer_name_or_path=None, model_name_or_path=MISSING_MODEL)
    return [
        f"loading the tokenizer from '{MISSING_MODEL}' (model_name_or_path): there is no such local path",
        "point model_name_or_path at an existing folder or a Hub id",
    ]


def sft_hub_id_offline(given, values):
    values.update(model_config=None, tokenizer_name_or_path=None, model_name_or_path="someone/some-model")
    return ["'someone/some-model'", "HF_HUB_OFFLINE is set", "no local folder 'someone/some-model' either"]


def sft_folder_without_a_tokenizer(given, values):
    (given.tmp / "no_tokenizer").mkdir()
    values["tokenizer_name_or_path"] = str(given.tmp / "no_tokenizer")
    return ["no_tokenizer' (tokenizer_name_or_path): it holds no tokenizer files"]


def sft_max_length_one(given, values):
    values["max_length"] = 1
    return ["max_length must be >= 2 (a causal LM example needs one token to read and one to predict), got 1"]


def sft_fewer_rows_than_one_step(given, values):
    values.update(dataset_name=few_chats(given, 3), eval_split_size=0, packing=False)
    return [
        "the training data has 3 rows, fewer than one optimizer step takes: 4 (per_device_train_batch_size 4 x 1 "
        "processes x gradient_accumulation_steps 1)",
        "repeat_small_dataset: true",
    ]


def sft_lora_targets_without_lora(given, values):
    values["lora_target_modules"] = ["q_proj"]
    return ["lora_target_modules and lora_modules_to_save choose what LoRA adapts: set use_peft: true"]


def sft_allow_config_change_without_resume(given, values):
    values["allow_config_change"] = ["packing"]
    return ["allow_config_change applies to a resumed run only"]


def sft_resume_with_another_packing(given, values):
    fake_checkpoint("sft", values, model_config=given.model_config, packing=False)
    return [
        "other settings that change the objective or the data (packing: False -> True)",
        "--allow_config_change packing",
    ]


def sft_binary_chat_template(given, values):
    values["chat_template"] = str(binary_file(given.tmp / "template.jinja"))
    return [
        f"reading chat_template '{given.tmp / 'template.jinja'}': it is not UTF-8 text",
        "point chat_template at another one",
    ]


def sft_resume_after_preemption_whose_checkpoint_was_deleted(given, values):
    (given.tmp / "out" / "checkpoints").mkdir(parents=True)
    (given.tmp / "out" / "checkpoints" / "PREEMPTED").write_text("step-00000008\n")
    return [
        "was preempted and saved step-00000008, which is no longer in checkpoints/",
        "restore it to resume, set resume_from_checkpoint to an older checkpoint folder, or remove checkpoints/PREEMPTED",
    ]


def sft_skip_nonfinite_steps_negative(given, values):
    values["skip_nonfinite_steps"] = -1
    return ["skip_nonfinite_steps"]


def sft_preemption_signals_naming_no_signal(given, values):
    values["preemption_signals"] = ["SIGTERM", "SIGNOPE"]
    return ["preemption_signals names 'SIGNOPE', not signals (e.g. SIGTERM, SIGUSR1, SIGUSR2)"]


def sft_preemption_on_sigkill(given, values):
    values["preemption_signals"] = ["SIGKILL"]
    return ["preemption_signals: SIGKILL and SIGSTOP cannot be caught"]


SFT_CASES = [
    sft_resume_after_preemption_whose_checkpoint_was_deleted,
    sft_skip_nonfinite_steps_negative,
    sft_preemption_signals_naming_no_signal,
    sft_preemption_on_sigkill,
    sft_model_path_missing,
    sft_hub_id_offline,
    sft_folder_without_a_tokenizer,
    sft_max_length_one,
    sft_fewer_rows_than_one_step,
    sft_lora_targets_without_lora,
    sft_allow_config_change_without_resume,
    sft_resume_with_another_packing,
    sft_binary_chat_template,
]


@pytest.mark.parametrize("case", SFT_CASES, ids=lambda case: case.__name__)
def test_sft_refuses(case, given, chat_data, capsys):
    values = base_recipe_values(given.model_config, chat_data, given.tmp / "out")
    assert_refused("sft", given, values, capsys, case(given, values))


# ------------------------------------------------------------------------------------------------------------ dpo
def dpo_model_path_missing(given, values):
    values["model_name_or_path"] = MISSING_MODEL
    return [f"'{MISSING_MODEL}' (model_name_or_path): there is no such local path"]


def dpo_tokenizer_hub_id_offline(given, values):
    values["tokenizer_name_or_path"] = "someone/tokenizer"
    return ["loading the tokenizer from 'someone/tokenizer' (tokenizer_name_or_path)", "HF_HUB_OFFLINE is set"]


def dpo_dataset_hub_id_offline(given, values):
    values["dataset_name"] = "someone/preferences"
    return ["dataset_name 'someone/preferences' could not be loaded", "HF_HUB_OFFLINE is set"]


def dpo_max_length_one(given, values):
    values.update(max_length=1, max_prompt_length=None)
    return ["max_length must be >= 2 (a pair's rows need a prompt token and an answer token predicted from it)"]


def dpo_fewer_pairs_than_one_step(given, values):
    pairs = [{"prompt": "reverse: abc", "chosen": "cba", "rejected": "abc"}] * 5
    values.update(dataset_name=str(write_jsonl(given.tmp / "pairs" / "train.jsonl", pairs)), eval_split_size=0)
    return [
        "the training data has 5 pairs, fewer than one optimizer step takes: 8 (per_device_train_batch_size 4 x 1 "
        "processes x gradient_accumulation_steps 2)"
    ]


def dpo_resume_with_another_beta(given, values):
    fake_checkpoint("dpo", values, model_config=given.pretrained / "config.json", beta=0.1, loss_type="ipo")
    return ["(beta: 0.1 -> 0.5; loss_type: 'ipo' -> 'sigmoid')", "--allow_config_change beta loss_type"]


def dpo_allow_a_misspelled_field(given, values):
    fake_checkpoint("dpo", values, model_config=given.pretrained / "config.json")
    values["allow_config_change"] = ["betta"]
    return ["allow_config_change: 'betta' is not a field that resuming checks; did you mean 'beta'?"]


def dpo_lora_module_to_save_that_does_not_exist(given, values):
    values.update(use_peft=True, lora_modules_to_save=["value_head"])
    return [
        "lora_modules_to_save names 'value_head', which match no module of this llama model",
        "Its modules with weights are: down_proj, embed_tokens",
    ]


def dpo_lora_target_that_does_not_exist(given, values):
    values.update(use_peft=True, lora_target_modules=["q_proj", "qkv_proj"])
    return ["lora_target_modules names 'qkv_proj', which match no module", "Its linear modules are: down_proj"]


DPO_CASES = [
    dpo_model_path_missing,
    dpo_tokenizer_hub_id_offline,
    dpo_dataset_hub_id_offline,
    dpo_max_length_one,
    dpo_fewer_pairs_than_one_step,
    dpo_resume_with_another_beta,
    dpo_allow_a_misspelled_field,
    dpo_lora_module_to_save_that_does_not_exist,
    dpo_lora_target_that_does_not_exist,
]


@pytest.mark.parametrize("case", DPO_CASES, ids=lambda case: case.__name__)
def test_dpo_refuses(case, given, pretrained_tiny_model, preference_data, capsys):
    given.pretrained = pretrained_tiny_model
    values = dpo_values(pretrained_tiny_model, preference_data, given.tmp / "out", gradient_accumulation_steps=2)
    assert_refused("dpo", given, values, capsys, case(given, values))


# ------------------------------------------------------------------------------------------------------- pretrain
def write_stories(folder: Path, count: int) -> Path:
    stories = (REPO / "demo" / "assets" / "text").glob("train-*.jsonl")
    lines = sorted(stories)[0].read_text().splitlines()[:count]
    write_jsonl(folder / "train.jsonl", [json.loads(line) for line in lines])
    return folder


def pretrain_binary_text_stream(given, values):
    values.update(dataset_name=str(binary_file(given.tmp / "corpus.txt")), streaming=True)
    return [f"reading dataset_name '{given.tmp / 'corpus.txt'}'", "it is not UTF-8 text (byte 0 is not valid UTF-8"]


def pretrain_binary_shard_in_a_stream(given, values):
    write_stories(given.tmp / "shards", 4)
    binary_file(given.tmp / "shards" / "train-2.txt")
    (given.tmp / "shards" / "train.jsonl").rename(given.tmp / "shards" / "train-1.txt")
    (given.tmp / "shards" / "train-1.txt").write_text("A story in plain text.")
    values.update(dataset_name=str(given.tmp / "shards"), streaming=True)
    return [f"{given.tmp / 'shards' / 'train-2.txt'}: it is not UTF-8 text", "move it out of the folder"]


def pretrain_chat_turns_as_the_text_column(given, values):
    values["dataset_name"] = str(write_jsonl(given.tmp / "chats.jsonl", [{"text": TURNS}] * 4))
    return [
        "column 'text' of the train split holds chat turns (lists of role/content), not text",
        "point dataset_text_field at a column of strings",
    ]


def pretrain_chat_turns_in_a_stream(given, values):
    values.update(dataset_name=str(write_jsonl(given.tmp / "chats.jsonl", [{"text": TURNS}] * 4)), streaming=True)
    return ["column 'text' of the train split holds chat turns"]


def pretrain_max_length_one(given, values):
    values["max_length"] = 1
    return ["max_length must be >= 2"]


def pretrain_corpus_smaller_than_one_step(given, values):
    values.update(
        dataset_name=str(write_stories(given.tmp / "small", 3)),
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        eval_split_size=0,
    )
    return ["less than one optimizer step takes of each rank (32 rows of max_length=64", "repeat_small_dataset: true"]


def pretrain_model_config_missing(given, values):
    values["model_config"] = "configs/tiny.json"
    return ["model_config: no such file 'configs/tiny.json'"]


def pretrain_resume_with_another_packing_strategy(given, values):
    fake_checkpoint("pretrain", values, model_config=given.model_config, packing_strategy="bfd")
    return ["(packing_strategy: 'bfd' -> 'wrapped')"]


def pretrain_tokenizer_path_missing(given, values):
    values["tokenizer_name_or_path"] = "./tokenizers/mine"
    return ["loading the tokenizer from './tokenizers/mine' (tokenizer_name_or_path): there is no such local path"]


PRETRAIN_CASES = [
    pretrain_binary_text_stream,
    pretrain_binary_shard_in_a_stream,
    pretrain_chat_turns_as_the_text_column,
    pretrain_chat_turns_in_a_stream,
    pretrain_max_length_one,
    pretrain_corpus_smaller_than_one_step,
    pretrain_model_config_missing,
    pretrain_resume_with_another_packing_strategy,
    pretrain_tokenizer_path_missing,
]


@pytest.mark.parametrize("case", PRETRAIN_CASES, ids=lambda case: case.__name__)
def test_pretrain_refuses(case, given, capsys):
    values = dict(
        model_config=str(given.model_config),
        tokenizer_name_or_path=str(TOKENIZER),
        max_length=64,
        dataset_name=str(write_stories(given.tmp / "corpus", 40)),
        max_steps=3,
        per_device_train_batch_size=2,
        output_dir=str(given.tmp / "out"),
        report_to="none",
        seed=7,
    )
    assert_refused("pretrain", given, values, capsys, case(given, values))


# ------------------------------------------------------------------------------------------------------- classify
@pytest.fixture(scope="module")
def two_class_classifier(tmp_path_factory, tiny_model_config, tokenizer) -> Path:
    """A trained-looking classifier folder for two classes (random weights): a base whose head has 2 rows."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("two_class")
    config = AutoConfig.from_pretrained(
        tiny_model_config, num_labels=2, id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1}
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def classify_chat_turns_as_text(given, values):
    data = [{"text": TURNS, "label": "x"}, {"text": TURNS, "label": "y"}] * 8
    values["dataset_name"] = str(write_jsonl(given.tmp / "chats.jsonl", data))
    return ["column 'text' of the train split holds chat turns", "point text_column at a column of strings"]


def classify_numbers_as_text(given, values):
    data = [{"text": 1, "label": "x"}, {"text": 2, "label": "y"}] * 8
    values["dataset_name"] = str(write_jsonl(given.tmp / "numbers.jsonl", data))
    return ["column 'text' of the train split holds int64, not text"]


def classify_head_for_other_classes(given, values):
    values.update(model_config=None, tokenizer_name_or_path=None, model_name_or_path=str(given.classifier))
    return [
        "is a classifier whose head has 2 classes (['neg', 'pos']), but the data has 3 (['high', 'low', 'mid'])",
        "Set ignore_mismatched_sizes: true",
    ]


def classify_max_length_one(given, values):
    values["max_length"] = 1
    return ["max_length must be >= 2 (a special token the tokenizer adds (BOS or CLS) and at least one token"]


def classify_fewer_rows_than_one_step(given, values):
    data = [{"text": "abc", "label": "x"}, {"text": "bcd", "label": "y"}] * 2
    values.update(dataset_name=str(write_jsonl(given.tmp / "few.jsonl", data)), eval_split_size=0.25)
    return ["the training data has 3 rows, fewer than one optimizer step takes: 8"]


def classify_resume_with_another_label_column(given, values):
    fake_checkpoint("classify", values, model_config=given.model_config, label_column="category")
    return ["(label_column: 'category' -> 'label')"]


def classify_model_path_missing(given, values):
    values.update(model_config=None, model_name_or_path="../classifiers/v2")
    return ["loading the model config from '../classifiers/v2' (model_name_or_path): there is no such local path"]


def classify_lora_module_to_save_misspelled(given, values):
    values.update(
        model_config=None,
        tokenizer_name_or_path=None,
        model_name_or_path=str(given.classifier),
        ignore_mismatched_sizes=True,
        use_peft=True,
        lora_modules_to_save=["scores"],
    )
    return ["lora_modules_to_save names 'scores', which match no module", "score"]


CLASSIFY_CASES = [
    classify_chat_turns_as_text,
    classify_numbers_as_text,
    classify_head_for_other_classes,
    classify_max_length_one,
    classify_fewer_rows_than_one_step,
    classify_resume_with_another_label_column,
    classify_model_path_missing,
    classify_lora_module_to_save_misspelled,
]


@pytest.mark.parametrize("case", CLASSIFY_CASES, ids=lambda case: case.__name__)
def test_classify_refuses(case, given, classify_data, two_class_classifier, capsys):
    given.classifier = two_class_classifier
    values = classify_values(given.model_config, classify_data, given.tmp / "out")
    assert_refused("classify", given, values, capsys, case(given, values))


# ----------------------------------------------------------------------------------------------------------- eval
def adapter_folder(given, base: str) -> Path:
    folder = given.tmp / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": base, "task_type": "CAUSAL_LM", "peft_type": "LORA"})
    )
    given.tokenizer.save_pretrained(folder)
    return folder


def eval_adapter_whose_base_is_gone(given, values):
    values["model_name_or_path"] = str(adapter_folder(given, MISSING_MODEL))
    return [
        f"is a LoRA adapter for the base model '{MISSING_MODEL}' (its adapter_config.json's "
        "base_model_name_or_path), which does not exist here",
        "Set --base_model_name_or_path",
    ]


def eval_base_override_that_is_gone_too(given, values):
    values.update(model_name_or_path=str(adapter_folder(given, MISSING_MODEL)), base_model_name_or_path="models/a/b")
    return ["loading the model config from 'models/a/b' (base_model_name_or_path): there is no such local path"]


def eval_base_override_for_a_plain_model(given, values):
    values["base_model_name_or_path"] = str(given.pretrained)
    return ["base_model_name_or_path is for LoRA adapters", "(folder): remove it"]


def eval_model_path_missing(given, values):
    values["model_name_or_path"] = "runs/sft/final"
    return ["loading the tokenizer from 'runs/sft/final' (model_name_or_path): there is no such local path"]


def eval_hub_id_offline(given, values):
    values["model_name_or_path"] = "someone/model"
    return ["loading the tokenizer from 'someone/model' (model_name_or_path)", "HF_HUB_OFFLINE is set"]


def eval_chat_turns_as_the_text_column(given, values):
    rows = [{"conversation": TURNS}] * 3
    values.update(dataset_name=str(write_jsonl(given.tmp / "chats.jsonl", rows)), text_column="conversation")
    return ["column 'conversation' of the eval split holds chat turns", "'messages' column"]


def eval_max_length_one(given, values):
    values["max_length"] = 1
    return ["max_length must be >= 2"]


def eval_binary_text_file(given, values):
    write_jsonl(given.tmp / "texts" / "a.jsonl", [{"text": "hello"}])
    binary_file(given.tmp / "texts" / "b.txt")
    values["dataset_name"] = str(given.tmp / "texts")
    return [f"{given.tmp / 'texts' / 'b.txt'}: it is not UTF-8 text"]


EVAL_CASES = [
    eval_adapter_whose_base_is_gone,
    eval_base_override_that_is_gone_too,
    eval_base_override_for_a_plain_model,
    eval_model_path_missing,
    eval_hub_id_offline,
    eval_chat_turns_as_the_text_column,
    eval_max_length_one,
    eval_binary_text_file,
]


@pytest.mark.parametrize("case", EVAL_CASES, ids=lambda case: case.__name__)
def test_eval_refuses(case, given, pretrained_tiny_model, chat_data, capsys):
    given.pretrained = pretrained_tiny_model
    values = dict(
        model_name_or_path=str(pretrained_tiny_model),
        dataset_name=str(chat_data),
        max_length=64,
        output_dir=str(given.tmp / "out"),
        metrics=["perplexity"],
        per_device_eval_batch_size=4,
    )
    assert_refused("eval", given, values, capsys, case(given, values))


# ------------------------------------------------------------------------------------- what the way out allows
def test_repeat_small_dataset_trains_and_says_so_in_the_run_summary(given, capsys):
    """The SFT case above, with the flag its message names: one step on 3 rows repeated to fill 4, noted."""
    from helpers.recipes import run_recipe_in_process

    values = base_recipe_values(
        given.model_config,
        Path(few_chats(given, 3)).parent,
        given.tmp / "out",
        max_steps=1,
        eval_split_size=0,
        packing=False,
        repeat_small_dataset=True,
        save_steps=None,
    )
    run_recipe_in_process("sft", given.tmp, "small", values)
    summary = json.loads((given.tmp / "out" / "run_summary.json").read_text())
    assert (
        summary["repeated_data"] == "3 training rows, fewer than one optimizer step takes (4): every step repeats rows"
    )


def test_a_corpus_part_smaller_than_one_step_is_noted_when_allowed(given):
    from fsdp_recipes.common.errors import DataError
    from fsdp_recipes.data import text

    train, _ = text.load_corpus(
        str(write_stories(given.tmp / "small", 3)),
        None,
        text_field="text",
        streaming=False,
        train_split="train",
        test_split=None,
        eval_split_size=0,
        seed=0,
    )
    tokenized = text.tokenize(train, given.tokenizer, "text")
    options = dict(rank=0, world_size=1, seed=0, max_length=64, rows_per_step=32)
    with pytest.raises(DataError, match="less than one optimizer step"):
        text.rank_documents(tokenized, **options)
    _, split = text.rank_documents(tokenized, **options, repeat_small_dataset=True)
    assert (
        split["repeated_data"]
        == "rank 0's part holds 701 tokens, less than one step's 2048: every step repeats documents"
    )


def test_a_classifier_max_length_counts_the_tokenizers_special_tokens(given):
    from datasets import Dataset

    from fsdp_recipes.common.errors import DataError
    from fsdp_recipes.methods.classify import classification

    class AddsClsAndSep:  # a BERT-like tokenizer: [CLS] text [SEP]
        def num_special_tokens_to_add(self, pair=False):
            return 3 if pair else 2

    data = Dataset.from_list([{"text": "abc", "label": "x"}])
    with pytest.raises(DataError, match=r"max_length=2 leaves no token of the text: the tokenizer adds 2 special"):
        classification.tokenize(
            data, AddsClsAndSep(), text_column="text", text_pair_column=None, labels=[0], max_length=2
        )


def test_base_model_name_or_path_points_an_adapter_at_its_base(given):
    from fsdp_recipes.publish import model_source

    folder = adapter_folder(given, MISSING_MODEL)
    source = model_source.resolve(str(folder), base_model_name_or_path="someone/base")
    assert (source.kind, source.base, source.config_files) == ("adapter", "someone/base", "someone/base")


# ------------------------------------------------------------------------------------------ chat answers, every recipe
USER = {"role": "user", "content": "reverse: abc"}
ANSWER = {"role": "assistant", "content": "cba"}
WRONG = {"role": "assistant", "content": "abc"}
DEGENERATE_ANSWERS = {
    "empty": ([{"role": "assistant", "content": ""}], "turn 1 (assistant) is empty"),
    "whitespace": ([{"role": "assistant", "content": " \n "}], "turn 1 (assistant) is only whitespace"),
    "no_final_answer": ([ANSWER, {"role": "user", "content": "and?"}], "its last turn must be the assistant's"),
}


def chat_rows(recipe: str, answer: list[dict], bad_row: int) -> list[dict]:
    """40 good examples in the recipe's chat format, the one at `bad_row` ending with `answer`."""
    if recipe in ("sft", "distill"):
        good, bad = {"messages": [USER, ANSWER]}, {"messages": [USER, *answer]}
    elif recipe == "kto":
        good = {"prompt": [USER], "completion": [ANSWER], "label": True}
        bad = {**good, "completion": answer}
    else:  # dpo, reward: pairs
        good = {"prompt": [USER], "chosen": [ANSWER], "rejected": [WRONG]}
        bad = {**good, "chosen": answer}
    rows = [dict(bad if index == bad_row else good) for index in range(40)]
    if recipe == "kto":  # good and bad answers both
        for index, row in enumerate(rows):
            row["label"] = index % 2 == 0
    return rows


@pytest.mark.parametrize(
    ("recipe", "answer"),
    [
        # each recipe's reader once or twice (distill reads SFT's data; a conversation may end with a user turn, an
        # answer given as a completion may not)
        ("sft", "empty"),
        ("sft", "whitespace"),
        ("dpo", "empty"),
        ("dpo", "no_final_answer"),
        ("kto", "whitespace"),
        ("kto", "no_final_answer"),
        ("reward", "no_final_answer"),
        ("distill", "empty"),
    ],
)
def test_a_degenerate_chat_answer_is_refused_with_its_row_in_every_recipe_that_trains_on_chat(
    recipe, answer, given, pretrained_tiny_model, student_config, capsys
):
    from fixtures.preference import kto_values
    from fixtures.reward_distill import distill_values, reward_values

    turns, expected = DEGENERATE_ANSWERS[answer]
    data = write_jsonl(given.tmp / "data" / "train.jsonl", chat_rows(recipe, turns, bad_row=7))
    out = given.tmp / "out"
    values = {
        "sft": lambda: base_recipe_values(given.model_config, data, out),
        "dpo": lambda: dpo_values(pretrained_tiny_model, data, out),
        "kto": lambda: kto_values(pretrained_tiny_model, data, out),
        "reward": lambda: reward_values(pretrained_tiny_model, data, out),
        "distill": lambda: distill_values(student_config, pretrained_tiny_model, data, out),
    }[recipe]()
    values["eval_split_size"] = 0.0  # no held-out part carved out: the row's index is its line in the file
    assert_refused(recipe, given, values, capsys, ["7 of the train split", expected])


@pytest.mark.parametrize("recipe", ["sft", "kto"])
def test_a_bad_example_is_named_by_its_row_in_the_file_when_a_held_out_part_was_carved_out(
    recipe, given, pretrained_tiny_model, capsys
):
    """eval_split_size carves held-out rows out of train at random: the row named is the file's, on either side."""
    from fixtures.preference import kto_values
    from fsdp_recipes.data import files

    turns, expected = DEGENERATE_ANSWERS["empty"]
    rows = chat_rows(recipe, turns, bad_row=29)
    data = write_jsonl(given.tmp / "data" / "train.jsonl", rows)
    out = given.tmp / "out"
    values = (
        base_recipe_values(given.model_config, data, out)
        if recipe == "sft"
        else kto_values(pretrained_tiny_model, data, out)
    )
    values["eval_split_size"] = 0.25
    raw = files.load_raw_dataset(str(data), None)
    train, held_out = files.split_train_eval(raw, "train", None, 0.25, values.get("seed", 42))
    part = held_out if 29 in [files.carving_of(held_out).row(i) for i in range(len(held_out))] else train
    assert part[[files.carving_of(part).row(i) for i in range(len(part))].index(29)] == raw["train"][29]
    assert_refused(recipe, given, values, capsys, ["29 of the train split", expected])
