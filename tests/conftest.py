"""Shared fixtures: a tiny model config, the repo's local tokenizer, small chat datasets, and a launcher that runs
real multi-process jobs with `accelerate launch` (gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # before the first import: their asserts report as a test's own do

from helpers.data import write_jsonl, write_tiny_model_config  # noqa: E402
from helpers.launch import concurrently, full_state_dict_config, launch, require_success, run_launched  # noqa: E402
from helpers.paths import CLASSIFY, DEMO_DATA, DPO, REPO, SFT, TOKENIZER  # noqa: E402
from helpers.recipes import base_recipe_values, recipe_config, run_recipe_in_process  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="session")
def tiny_model_config(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model_config(tmp_path_factory.mktemp("model") / "config.json", tokenizer)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """256 training conversations and 32 held-out ones from the demo task."""
    folder = tmp_path_factory.mktemp("chat")
    train = [json.loads(line) for line in (DEMO_DATA / "train.jsonl").read_text().splitlines()[:256]]
    test = [json.loads(line) for line in (DEMO_DATA / "test.jsonl").read_text().splitlines()[:32]]
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    return folder


# ----------------------------------------------------------------------------------------------- shared SFT launches
# Process start-up dominates the suite's time (a 2-process launch costs ~15 s here), so these few real launches are
# shared by every test module that needs a trained run: one reference run serves sharding, metrics, export and
# checkpoint tests; one run killed while saving serves the fault tests and every resume.
STEPS = 12


def resume_values(tiny_model_config: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """2 processes x 4 rows x 2 accumulation steps over 64 rows: steps 1-4 are epoch 0, so the interruption at step 6
    falls mid-epoch and the run crosses two epoch boundaries. A checkpoint every 3 steps; exact match on 4 held-out
    examples (it runs before training, and a resumed run must read it from the log)."""
    values = dict(max_steps=STEPS, save_steps=3, gradient_accumulation_steps=2, eval_steps=None, packing=False,
                  exact_match_eval_samples=4, max_new_tokens=4)
    values.update(overrides)
    return base_recipe_values(tiny_model_config, data, output_dir, **values)


@pytest.fixture(scope="session")
def small_chat_data(tmp_path_factory, chat_data) -> Path:
    folder = tmp_path_factory.mktemp("small_chat")
    lines = (chat_data / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (folder / "test.jsonl").write_text((chat_data / "test.jsonl").read_text())
    return folder


def run_sft(tmp: Path, name: str, values: dict, **options):
    return run_launched(SFT, tmp, name, values, **options)


@pytest.fixture(scope="session")
def sft_launches(tmp_path_factory, tiny_model_config, small_chat_data) -> dict:
    """The reference run and the killed one (below), launched side by side."""
    import time

    reference, killed = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("killed")
    reference_values = resume_values(tiny_model_config, small_chat_data, reference / "out", save_total_limit=2,
                                     report_to="tensorboard")
    killed_values = resume_values(tiny_model_config, small_chat_data, killed / "out", save_total_limit=2)

    def killed_run():
        result = run_sft(killed, "killed", killed_values, expect_success=False,
                         env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"})
        return killed / "out", killed_values, result, time.time()

    _, killed_outcome = concurrently(lambda: run_sft(reference, "reference", reference_values), killed_run)
    return {"reference": reference / "out", "killed": killed_outcome}


@pytest.fixture(scope="session")
def reference_run(sft_launches) -> Path:
    """The uninterrupted 2-process FSDP2 run (SHARDED_STATE_DICT, fp32), keeping its newest 2 checkpoints."""
    return sft_launches["reference"]


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, tiny_model_config, small_chat_data) -> Path:
    """The reference run's global batch on 1 process (8 rows per micro-batch), in this process (no launcher, no FSDP),
    with a peak FLOP/s for MFU, and the loss from whole logits where the reference run uses the (default) chunked
    cross-entropy."""
    tmp = tmp_path_factory.mktemp("one_process")
    values = resume_values(tiny_model_config, small_chat_data, tmp / "out", per_device_train_batch_size=8,
                           peak_flops_per_device=1e12, save_steps=None, exact_match_eval_samples=0,
                           loss_implementation="full_logits")
    run_recipe_in_process("sft", tmp, "one", values)
    return tmp / "out"


@pytest.fixture(scope="session")
def killed_during_save(sft_launches):
    """The reference run, but rank 1 is SIGKILLed while step 6's checkpoint is being written: the launcher must stop
    rank 0, and the latest complete checkpoint is step 3's. Returns (output_dir, values, result, finished_at)."""
    return sft_launches["killed"]


@pytest.fixture(scope="session")
def full_state_dict_run(tmp_path_factory, tokenizer, small_chat_data) -> Path:
    """2 processes with FULL_STATE_DICT, a model with tied embeddings, the model's own activation checkpointing and
    the fused AdamW kernel."""
    tmp = tmp_path_factory.mktemp("full_state_dict")
    tied_config = write_tiny_model_config(tmp / "tied.json", tokenizer, tie_word_embeddings=True)
    full_yaml = full_state_dict_config(tmp)
    values = resume_values(tied_config, small_chat_data, tmp / "out", max_steps=4, save_steps=4,
                           gradient_checkpointing=True, optim="adamw_torch_fused", exact_match_eval_samples=0)
    run_sft(tmp, "full", values, accelerate_config=full_yaml)
    return tmp / "out"


# ----------------------------------------------------------------------------------- classify and eval: shared launch
CLASSIFY_STEPS = 40
CLASSIFY_TEST_ROWS = 45  # 2 ranks x 8 rows per eval batch: the last of 3 global batches holds 13 rows, so accelerate
# pads it with copies that gather_for_metrics must drop


def first_letter_examples(count: int, seed: int) -> list[dict]:
    """Random lowercase strings labelled by their first letter: "low" (a-i), "mid" (j-r) or "high" (s-z). The label
    is at the first token and the classifier pools the last, so attention must carry it."""
    import random
    import string

    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))
        examples.append({"text": text, "label": ["low", "mid", "high"][string.ascii_lowercase.index(text[0]) * 3 // 26]})
    return examples


@pytest.fixture(scope="session")
def classify_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("classify_data")
    write_jsonl(folder / "train.jsonl", first_letter_examples(384, seed=0))
    write_jsonl(folder / "test.jsonl", first_letter_examples(CLASSIFY_TEST_ROWS, seed=1))
    return folder


def classify_values(tiny_model_config: Path, data: Path, output_dir: Path, **overrides) -> dict:
    values = base_recipe_values(tiny_model_config, data, output_dir, max_length=32, max_steps=CLASSIFY_STEPS,
                                per_device_train_batch_size=8, per_device_eval_batch_size=8, logging_steps=5,
                                eval_steps=20, save_steps=CLASSIFY_STEPS, report_to="none")
    values.update(overrides)
    return values


@pytest.fixture(scope="session")
def classify_run(tmp_path_factory, tiny_model_config, classify_data) -> Path:
    """recipes/classify.py under a real 2-process FSDP2 launch: 40 steps of 16 rows, metrics at steps 20 and 40, a
    checkpoint at the last step (evaluated again by the eval recipe's tests)."""
    tmp = tmp_path_factory.mktemp("classify")
    values = classify_values(tiny_model_config, classify_data, tmp / "out")
    require_success(launch(CLASSIFY, ["--config", str(recipe_config(tmp / "classify.yaml", **values))]))
    return tmp / "out"


# ------------------------------------------------------------------------------------------------ LoRA: shared launches
@pytest.fixture(scope="session")
def pretrained_tiny_model(tmp_path_factory, tokenizer) -> Path:
    """A model folder with weights (LoRA adapts pretrained weights, and its adapter is reloaded onto them)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("pretrained")
    config = LlamaConfig.from_json_file(write_tiny_model_config(folder / "source.json", tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def lora_values(model: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """resume_values with LoRA on a pretrained model: rank 4 on every linear layer of the decoder blocks, no dropout
    (dropout draws differ between one and two processes)."""
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2)
    values = resume_values(model, data, output_dir, **{**lora, **overrides})
    values.pop("model_config")
    values.pop("tokenizer_name_or_path")
    return {**values, "model_name_or_path": str(model)}


@pytest.fixture(scope="session")
def lora_launches(tmp_path_factory, pretrained_tiny_model, small_chat_data) -> dict:
    """The LoRA reference run and the killed one (below), launched side by side."""
    reference, killed = tmp_path_factory.mktemp("lora_reference"), tmp_path_factory.mktemp("lora_killed")
    values = lora_values(pretrained_tiny_model, small_chat_data, killed / "out", export_merged_model=True)
    full = full_state_dict_config(killed)
    concurrently(
        lambda: run_sft(reference, "lora", lora_values(pretrained_tiny_model, small_chat_data, reference / "out",
                                                       export_merged_model=True)),
        lambda: run_sft(killed, "killed", values, expect_success=False, accelerate_config=full,
                        env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"}),
    )
    return {"reference": reference / "out", "killed": (killed / "out", values, full)}


@pytest.fixture(scope="session")
def lora_reference_run(lora_launches) -> Path:
    """2 processes, SHARDED_STATE_DICT, the merged model exported too; checkpoints every 3 steps."""
    return lora_launches["reference"]


@pytest.fixture(scope="session")
def lora_one_process_run(tmp_path_factory, pretrained_tiny_model, small_chat_data) -> Path:
    """The reference's global batch on 1 process, in this process (no launcher, no FSDP)."""
    tmp = tmp_path_factory.mktemp("lora_one_process")
    values = lora_values(pretrained_tiny_model, small_chat_data, tmp / "out", per_device_train_batch_size=8,
                         exact_match_eval_samples=0)
    run_recipe_in_process("sft", tmp, "lora_one", values)
    return tmp / "out"


@pytest.fixture(scope="session")
def lora_killed_during_save(lora_launches):
    """The LoRA reference run, but with FULL_STATE_DICT checkpoints, and rank 1 killed while saving step 6.
    Returns (output_dir, values, accelerate config)."""
    return lora_launches["killed"]


@pytest.fixture(scope="session")
def lora_resumes(tmp_path_factory, lora_reference_run, lora_killed_during_save) -> dict[int, Path]:
    """Launched side by side: a copy of the killed LoRA run resumed (FULL_STATE_DICT, 2 processes) to the end; and a
    copy of the reference run resumed from its step-6 SHARDED_STATE_DICT checkpoint on 1 process with the same global
    batch (DCP reshards the adapters and their optimizer state). {processes: output_dir}."""
    import shutil

    source, values, full = lora_killed_during_save
    killed, reference = tmp_path_factory.mktemp("lora_resumed_on_2"), tmp_path_factory.mktemp("lora_resumed_on_1")
    shutil.copytree(source, killed / "out")
    shutil.copytree(lora_reference_run, reference / "out",  # without the newer checkpoints, which it would redo
                    ignore=shutil.ignore_patterns("step-00000009", "step-00000012"))
    checkpoint = reference / "out" / "checkpoints" / "step-00000006"
    on_one = {**values, "output_dir": str(reference / "out"), "resume_from_checkpoint": str(checkpoint),
              "per_device_train_batch_size": 8, "exact_match_eval_samples": 0}
    concurrently(
        lambda: run_sft(killed, "resumed", {**values, "output_dir": str(killed / "out"),
                                            "resume_from_checkpoint": "latest"}, accelerate_config=full),
        lambda: run_sft(reference, "resumed", on_one, num_processes=1),
    )
    return {2: killed / "out", 1: reference / "out"}


@pytest.fixture(scope="session")
def lora_resumed_run(lora_resumes) -> Path:
    """The killed LoRA run resumed on 2 processes."""
    return lora_resumes[2]


# ------------------------------------------------------------------------------------------------ DPO: shared launches
DPO_STEPS = 8


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory) -> Path:
    """64 training pairs and 16 held-out ones from the DPO demo's data (conversational, explicit prompt)."""
    folder = tmp_path_factory.mktemp("pairs")
    source = REPO / "demo" / "assets" / "reverse_preferences"
    (folder / "train.jsonl").write_text("\n".join((source / "train.jsonl").read_text().splitlines()[:64]) + "\n")
    (folder / "test.jsonl").write_text("\n".join((source / "test.jsonl").read_text().splitlines()[:16]) + "\n")
    return folder


def dpo_values(model: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """2 processes x 4 pairs x 2 accumulation steps = 16 pairs per step (8 rows of 2 x 4 per micro-batch), fp32, a
    checkpoint every 3 steps, held-out figures every 4."""
    values = dict(model_name_or_path=str(model), dataset_name=str(data), output_dir=str(output_dir), max_length=48,
                  max_steps=DPO_STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                  gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=0, logging_steps=1, eval_steps=4,
                  save_steps=3, seed=7, report_to="none", beta=0.5)
    values.update(overrides)
    return values


def run_dpo(tmp: Path, name: str, values: dict, **options):
    return run_launched(DPO, tmp, name, values, **options)


@pytest.fixture(scope="session")
def dpo_launches(tmp_path_factory, pretrained_tiny_model, preference_data) -> dict:
    """Full DPO on 2 processes, the reference a frozen copy sharded like the policy; the same run with rank 1 killed
    while saving step 6; and the same run with the reference's values precomputed (no checkpoints): launched side by
    side."""
    reference, killed, precomputed = (tmp_path_factory.mktemp(name) for name in ("dpo_reference", "dpo_killed",
                                                                                  "dpo_precomputed"))
    killed_values = dpo_values(pretrained_tiny_model, preference_data, killed / "out")
    _, killed_result, _ = concurrently(
        lambda: run_dpo(reference, "dpo", dpo_values(pretrained_tiny_model, preference_data, reference / "out")),
        lambda: run_dpo(killed, "killed", killed_values, expect_success=False,
                        env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"}),
        lambda: run_dpo(precomputed, "precomputed", dpo_values(pretrained_tiny_model, preference_data,
                                                               precomputed / "out", precompute_ref_log_probs=True,
                                                               save_steps=None)),
    )
    return {"reference": reference / "out", "killed": (killed / "out", killed_values, killed_result),
            "precomputed": precomputed / "out"}


@pytest.fixture(scope="session")
def dpo_reference_run(dpo_launches) -> Path:
    return dpo_launches["reference"]
