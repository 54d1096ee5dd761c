"""Configs written for TRL / alignment-handbook run here: handbook-shaped SFT and DPO YAMLs (keys and values as the
handbook's published recipes have them; only Hub ids point at local stand-ins, the stand-in tokenizer's end token
replaces <|im_end|>, and sizes are scaled to a CPU test), dataset mixtures, the upstream keys' checks and errors,
and logging at the config's log_level. All in this process: no launch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from helpers.data import write_jsonl
from helpers.paths import DEMO_DATA
from helpers.recipes import base_recipe_values, read_metrics, recipe_error_in_process, run_recipe_main

STAND_IN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def library_log_levels_restored():
    """A config's log_level sets transformers' and datasets' levels for the process: put them back for other tests."""
    import datasets
    import transformers

    levels = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity()
    yield
    transformers.utils.logging.set_verbosity(levels[0])
    datasets.utils.logging.set_verbosity(levels[1])
    datasets.enable_progress_bars()


@pytest.fixture(scope="module")
def hub_like_data(tmp_path_factory) -> Path:
    """A folder laid out like a Hub dataset (smoltalk2's: config SFT with named splits; ultrafeedback's: default
    config, train_prefs/test_prefs with whole conversations in chosen and rejected), read offline by load_dataset."""
    folder = tmp_path_factory.mktemp("hub_like")
    conversations = [json.loads(line) for line in (DEMO_DATA / "train.jsonl").read_text().splitlines()[:40]]
    (folder / "SFT").mkdir()
    write_jsonl(folder / "SFT" / "everyday-00000-of-00001.jsonl", conversations[:6])
    write_jsonl(folder / "SFT" / "systemchats-00000-of-00001.jsonl", conversations[6:10])
    pairs = [
        {
            "chosen": turns["messages"],
            "rejected": [turns["messages"][0], {"role": "assistant", "content": turns["messages"][0]["content"][9:]}],
            "score": 1.0,
        }
        for turns in conversations
    ]
    (folder / "prefs").mkdir()
    write_jsonl(folder / "prefs" / "train_prefs-00000-of-00001.jsonl", pairs[:24])
    write_jsonl(folder / "prefs" / "test_prefs-00000-of-00001.jsonl", pairs[24:32])
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: SFT\n  data_files:\n"
        "  - split: everyday_conversations_no_think\n    path: SFT/everyday-*.jsonl\n"
        "  - split: systemchats_30k_no_think\n    path: SFT/systemchats-*.jsonl\n"
        "- config_name: default\n  data_files:\n"
        "  - split: train_prefs\n    path: prefs/train_prefs-*.jsonl\n"
        "  - split: test_prefs\n    path: prefs/test_prefs-*.jsonl\n"
        "---\n"
    )
    return folder


def handbook_sft_yaml(model: Path, data: Path, output_dir: Path) -> str:
    """alignment-handbook recipes/smollm3/sft/sft.yaml, key for key (hub_strategy aside: the Hub push's own work)."""
    return f"""
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: bfloat16
attn_implementation: sdpa  # flash_attention_2 in the handbook: a GPU kernel
trust_remote_code: true

# Data training arguments
chat_template: {json.dumps(STAND_IN_TEMPLATE)}
dataset_mixture:
  datasets:
    - id: {data}
      config: SFT
      split: everyday_conversations_no_think
      columns:
        - messages
      weight: 1.0
    - id: {data}
      config: SFT
      split: systemchats_30k_no_think
      columns:
        - messages
      weight: 0.5
  seed: 0
dataset_num_proc: 1
eos_token: <|end|>

# SFT trainer config
assistant_only_loss: true
bf16: true
ddp_timeout: 18000 # avoid nccl errors when tokenizing large datasets
do_eval: false
eval_strategy: 'no'
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: true
output_dir: {output_dir}
learning_rate: 2.0e-05
log_level: info
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
packing: true
packing_strategy: ffd
max_grad_norm: 0.2
max_length: 64
max_steps: -1
num_train_epochs: 2
overwrite_output_dir: true
per_device_train_batch_size: 1
push_to_hub: false
report_to:
- tensorboard
save_strategy: epoch
save_total_limit: 1
seed: 42
use_liger_kernel: true
warmup_ratio: 0.03
run_name: smollm3-sft-training
average_tokens_across_devices: true
"""


def handbook_dpo_yaml(model: Path, data: Path, output_dir: Path) -> str:
    """alignment-handbook recipes/smollm2/dpo/config.yaml, key for key (wandb, not installed here, left out of
    report_to)."""
    return f"""
# Model arguments
model_name_or_path: {model}
torch_dtype: bfloat16

# Data training arguments
dataset_mixture:
  datasets:
    - id: {data}
      config: default
      split: train_prefs
      columns:
        - chosen
        - rejected
      weight: 1.0
    - id: {data}
      config: default
      split: test_prefs
      columns:
        - chosen
        - rejected
      weight: 1.0
  test_split_size: 8
  seed: 0
dataset_num_proc: 1

# DPOTrainer arguments
bf16: true
beta: 0.5
do_eval: true
hub_private_repo: true
eval_strategy: steps
eval_steps: 2
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: False
hub_model_id: smollm2-1.7B-dpo
learning_rate: 1.0e-6
log_level: info
logging_steps: 1
lr_scheduler_type: cosine
max_length: 48
max_prompt_length: 24
num_train_epochs: 1
optim: adamw_torch
output_dir: {output_dir}
per_device_train_batch_size: 4
per_device_eval_batch_size: 4
push_to_hub: false
report_to:
- tensorboard
save_strategy: "no"
seed: 42
warmup_ratio: 0.1
"""


def run_yaml(recipe: str, path: Path, text: str, *extra: str) -> None:
    path.write_text(text)
    run_recipe_main(recipe, ["--config", str(path), *extra])


def test_handbook_sft_yaml_runs_unchanged_but_for_liger_on_cpu(tmp_path, pretrained_tiny_model, hub_like_data, capsys):
    """The SmolLM3 recipe asks for liger-kernel's Triton kernels, which only a CUDA GPU runs: on this machine that one
    key is refused before loading, with the way out, and the YAML runs once it is turned off on the command line."""
    out = tmp_path / "out"
    yaml_text = handbook_sft_yaml(pretrained_tiny_model, hub_like_data, out)
    with pytest.raises(SystemExit):
        run_yaml("sft", tmp_path / "sft.yaml", yaml_text)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: use_liger_kernel: true needs a CUDA GPU (liger-kernel's kernels are Triton's); this run is on cpu: run "
        "it on a GPU, or set use_liger_kernel: false (the same operations then run unfused)"
    ]
    assert not out.exists()
    run_yaml("sft", tmp_path / "sft.yaml", yaml_text, "--use_liger_kernel", "false")
    printed = capsys.readouterr().out
    summary = json.loads((out / "run_summary.json").read_text())
    # the mixture: 6 rows of one split, half of the other's 4 (weight 0.5); no held-out part (evaluation is off)
    assert summary["data"]["examples"] == 8 and summary["eval_rows"] == 0
    notes = summary["upstream_keys"]
    assert notes["torch_dtype"].startswith("renamed: read as dtype")
    assert notes["average_tokens_across_devices"].startswith("ignored:") and "use_liger_kernel" not in notes
    assert printed.count("upstream_keys") == 1  # listed once
    assert "peak_memory_gib_max: measured on the busiest rank: the process's peak resident memory" in printed
    records = read_metrics(out)
    steps = [record for record in records if "loss" in record]
    total = summary["optimizer_steps"]
    assert [record["step"] for record in steps] == list(range(1, total + 1))  # logging_strategy steps, every step
    assert not any("eval_loss" in record for record in records)  # eval_strategy 'no', do_eval false
    # cosine_with_min_lr with min_lr_rate 0.1 ends at a tenth of the peak
    assert steps[-1]["lr"] == pytest.approx(2e-6, rel=1e-3)
    # save_strategy epoch: one checkpoint per epoch, the newest kept (save_total_limit 1)
    assert [path.name for path in (out / "checkpoints").glob("step-*")] == [f"step-{total:08d}"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).eos_token == "<|end|>"
    assert (out / "sft").is_dir()  # the TensorBoard tracker's folder: the project (the recipe's name by default)


def test_handbook_dpo_yaml_runs_unchanged(tmp_path, pretrained_tiny_model, hub_like_data):
    out = tmp_path / "out"
    run_yaml("dpo", tmp_path / "dpo.yaml", handbook_dpo_yaml(pretrained_tiny_model, hub_like_data, out))
    summary = json.loads((out / "run_summary.json").read_text())
    assert (summary["train_pairs"], summary["eval_pairs"]) == (24, 8)  # test_split_size 8 of 32 mixed pairs
    total = summary["optimizer_steps"]
    assert total == 3  # 24 pairs, 4 per micro-batch, 2 micro-batches a step
    evaluated = [record["step"] for record in read_metrics(out) if "eval_loss" in record]
    assert evaluated == [2, 3]  # eval_strategy steps, eval_steps 2, and the end
    assert not (out / "checkpoints").exists()  # save_strategy "no"


def test_mixture_weights_are_deterministic_fractions_and_repeats(hub_like_data):
    from fsdp_recipes.data.mixture import load_mixture

    def mixture(weights, **extra):
        splits = ("everyday_conversations_no_think", "systemchats_30k_no_think")
        datasets = [
            {"id": str(hub_like_data), "config": "SFT", "split": split, "weight": weight}
            for split, weight in zip(splits, weights)
        ]
        return load_mixture({"datasets": datasets, "seed": 3, **extra})

    assert len(mixture([1.0, 0.5])["train"]) == 8
    assert len(mixture([2.0, 0.0])["train"]) == 12  # weight 2: every row twice
    first, again = mixture([0.5, 1.0])["train"], mixture([0.5, 1.0])["train"]
    assert first["messages"] == again["messages"]  # same mixture, same seed: same rows in the same order
    split = mixture([1.0, 1.0], test_split_size=0.25)
    assert (len(split["train"]), len(split["test"])) == (7, 3)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"weight": -1.0}, "weight is -1.0"),
        ({"split": "no_such_split"}, "has no split 'no_such_split'"),
        ({"columns": ["messages", "chat_template_kwargs"]}, "has no column 'chat_template_kwargs'"),
    ],
)
def test_a_bad_dataset_in_the_mixture_is_named(tmp_path, tiny_model_config, hub_like_data, capsys, change, expected):
    good = {"id": str(hub_like_data), "config": "SFT", "split": "everyday_conversations_no_think"}
    bad = {"id": str(hub_like_data), "config": "SFT", "split": "systemchats_30k_no_think", **change}
    values = base_recipe_values(tiny_model_config, None, tmp_path / "out", dataset_mixture={"datasets": [good, bad]})
    del values["dataset_name"]
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert expected in error and "datasets[1]" in error, error
    assert not (tmp_path / "out").exists()


def test_mixture_weights_all_zero_are_refused(tmp_path, tiny_model_config, hub_like_data, capsys):
    datasets = [{"id": str(hub_like_data), "config": "SFT", "split": "systemchats_30k_no_think", "weight": 0}]
    values = base_recipe_values(tiny_model_config, None, tmp_path / "out", dataset_mixture={"datasets": datasets})
    del values["dataset_name"]
    assert "weights are all 0" in recipe_error_in_process("sft", tmp_path, values, capsys)


@pytest.mark.parametrize("launch_precision", ["no", "fp16"])
def test_bf16_must_agree_with_the_accelerate_config(
    tmp_path, tiny_model_config, chat_data, capsys, monkeypatch, launch_precision
):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launch_precision)  # what accelerate launch exports
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out", bf16=True)
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert "bf16: true" in error and f"mixed_precision is {launch_precision!r}" in error, error


@pytest.mark.parametrize(
    ("scheduler", "kwargs", "expected"),
    [
        ("cosine", {"min_lr_rate": 0.1}, "lr_scheduler_kwargs min_lr_rate: cosine takes num_cycles"),
        ("cosine_with_min_lr", None, "min_lr"),
        ("linear", {"power": 2}, "linear takes no arguments"),
    ],
)
def test_scheduler_kwargs_are_checked_before_loading(
    tmp_path, tiny_model_config, chat_data, capsys, scheduler, kwargs, expected
):
    values = base_recipe_values(
        tiny_model_config, chat_data, tmp_path / "out", lr_scheduler_type=scheduler, lr_scheduler_kwargs=kwargs
    )
    assert expected in recipe_error_in_process("sft", tmp_path, values, capsys)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("deepspeed", "ds_config.json", "fsdp-recipes from-deepspeed"),
        ("fsdp", "full_shard auto_wrap", "Accelerate config"),
        ("fsdp_config", {"fsdp_version": 2}, "Accelerate config"),
        ("local_rank", 0, "the launcher sets each process's rank"),
        ("average_tokens_across_devices", False, "always the mean over every target token"),
    ],
)
def test_keys_that_cannot_mean_anything_here_say_where_they_live(
    tmp_path, tiny_model_config, chat_data, capsys, key, value, expected
):
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out", **{key: value})
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert key in error and expected in error, error


def test_old_and_upstream_names_are_read(tmp_path):
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train import loop, trainer_arguments
    from helpers.recipes import load_recipe

    config_class = load_recipe("sft").SFTConfig
    path = tmp_path / "old.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "dataset_name": "x.jsonl",
                "model_name_or_path": "org/model",
                "max_seq_length": 96,
                "report_to": ["tensorboard"],
            }
        )
    )
    argv = ["--config", str(path), "--warmup_steps", "0.25", "--lr_scheduler_kwargs", '{"num_cycles": 1.0}']
    config = parse_config(config_class, argv)
    assert config.max_length == 96 and config.trackers() == ["tensorboard"]
    assert config.upstream_notes["max_seq_length"].startswith("renamed: read as max_length")
    assert (
        trainer_arguments.warmup_steps(config, total_steps=40) == 10
    )  # a fraction of the run, as transformers 5 reads it
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    assert loop.build_scheduler(optimizer, config, total_steps=40).lr_lambdas[0](10) == pytest.approx(1.0)
    path.write_text(yaml.safe_dump({"dataset_name": "x.jsonl", "max_seq_length": 96, "max_length": 64}))
    with pytest.raises(ConfigError, match="max_seq_length .* and max_length .* disagree"):
        parse_config(config_class, ["--config", str(path)])
    with pytest.raises(ConfigError, match="--max_seq_length is called --max_length here"):
        parse_config(config_class, ["--config", str(path), "--max_seq_length", "8"])


def test_log_level_warning_silences_info_lines(tmp_path, tiny_model_config, chat_data, capsys):
    values = base_recipe_values(
        tiny_model_config, chat_data, tmp_path / "out", max_steps=2, save_steps=None, log_level="warning"
    )
    run_yaml("sft", tmp_path / "quiet.yaml", yaml.safe_dump(values))
    printed = capsys.readouterr().out
    assert "run summary" not in printed and "final metrics" not in printed and "step=1" not in printed, printed
    assert (tmp_path / "out" / "model.safetensors").is_file() and len(read_metrics(tmp_path / "out")) >= 2


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        # (logging, eval, save) due steps over a 6-step run of 3 steps an epoch
        ({}, ([1, 2, 3, 4, 5, 6], [6], [2, 4, 6])),
        ({"eval_strategy": "epoch", "save_strategy": "epoch", "logging_strategy": "epoch"}, ([3, 6], [3, 6], [3, 6])),
        ({"eval_strategy": "no", "save_strategy": "no", "logging_strategy": "no"}, ([], [], [])),
        ({"eval_strategy": "no", "do_eval": True}, ([1, 2, 3, 4, 5, 6], [6], [2, 4, 6])),
        ({"eval_steps": 4, "do_eval": False}, ([1, 2, 3, 4, 5, 6], [], [2, 4, 6])),
    ],
)
def test_strategies_decide_when_each_component_acts(settings, expected):
    from types import SimpleNamespace

    from fsdp_recipes.train import trainer_arguments

    config = SimpleNamespace(
        **{
            "logging_strategy": "steps",
            "eval_strategy": "steps",
            "save_strategy": "steps",
            "do_eval": None,
            "logging_steps": 1,
            "eval_steps": None,
            "save_steps": 2,
            **settings,
        }
    )
    due = tuple(
        [
            step
            for step in range(1, 7)
            if trainer_arguments.cadence(config, kind, total_steps=6, steps_per_epoch=3).due(step)
        ]
        for kind in ("logging", "eval", "save")
    )
    assert due == expected


def test_eos_token_must_be_in_the_vocabulary(tmp_path, tiny_model_config, chat_data, capsys):
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out", eos_token="<|im_end|>")
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert "eos_token '<|im_end|>' is not a token of the tokenizer's vocabulary" in error, error


def test_ddp_timeout_and_precision_reach_the_accelerator(tmp_path, monkeypatch):
    import datetime

    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.run.starting import accelerator_for
    from fsdp_recipes.train.config import TrainingConfig

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # no Accelerate config: bf16 turns it on
    argv = ["--dataset_name", "x.jsonl", "--model_name_or_path", "org/m", "--report_to", "none"]
    config = parse_config(TrainingConfig, [*argv, "--ddp_timeout", "18000", "--bf16", "true"])
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator, parallel = accelerator_for(config)
        assert parallel == ParallelDims() and parallel.mesh is None  # one process, nothing launched
        assert accelerator.init_handler.timeout == datetime.timedelta(seconds=18000)
        assert accelerator.mixed_precision == "bf16"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_upstream_keys_on_the_command_line_say_where_they_live():
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train.config import TrainingConfig

    with pytest.raises(ConfigError) as refused:
        parse_config(TrainingConfig, ["--dataset_name", "x.jsonl", "--deepspeed", "ds.json", "--local_rank", "0"])
    problems = " | ".join(refused.value.problems)
    assert "--deepspeed cannot be set here" in problems and "from-deepspeed" in problems
    assert "--local_rank cannot be set here: the launcher sets each process's rank" in problems


def test_trl_gkd_keys_off_are_noted_and_on_are_refused_naming_what_is_missing(tmp_path):
    """A TRL GKDConfig's `lmbda: 0` / `seq_kd: false` mean what distillation here does (listed as ignored); on-policy
    or sequence-level KD is refused with one line each, before anything loads."""
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train.config import TrainingConfig

    config_file = tmp_path / "gkd.yaml"
    config_file.write_text("model_name_or_path: org/model\ndataset_name: x.jsonl\nlmbda: 0.0\nseq_kd: false\n")
    config = parse_config(TrainingConfig, ["--config", str(config_file)])
    assert config.upstream_notes["lmbda"].startswith("ignored: on-policy distillation")
    assert config.upstream_notes["seq_kd"].startswith("ignored: sequence-level KD")
    config_file.write_text("model_name_or_path: org/model\ndataset_name: x.jsonl\nlmbda: 0.5\nseq_kd: true\n")
    with pytest.raises(ConfigError) as refused:
        parse_config(TrainingConfig, ["--config", str(config_file)])
    problems = refused.value.problems
    assert any(p.startswith("lmbda: 0.5 in ") and "on-policy distillation" in p and "remove it" in p for p in problems)
    assert any(p.startswith("seq_kd: True in ") and "sequence-level KD" in p for p in problems)


def test_trls_use_transformers_paged_is_the_paged_generation_backend(tmp_path):
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train.config import TrainingConfig
    from helpers.recipes import load_recipe

    grpo = load_recipe("grpo").GRPOConfig
    base = "model_name_or_path: org/model\ndataset_name: x.jsonl\nreward_funcs: [exact_match]\n"
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(base + "use_transformers_paged: true\n")
    config = parse_config(grpo, ["--config", str(config_file)])
    assert (
        config.generation_backend == "paged" and "generation_backend" in config.upstream_notes["use_transformers_paged"]
    )
    config_file.write_text(base + "use_transformers_paged: false\n")
    assert parse_config(grpo, ["--config", str(config_file)]).generation_backend == "generate"
    config_file.write_text(base + "use_transformers_paged: true\ngeneration_backend: static_compiled\n")
    with pytest.raises(ConfigError) as refused:
        parse_config(grpo, ["--config", str(config_file)])
    assert any("disagree" in p for p in refused.value.problems)
    with pytest.raises(ConfigError) as refused:  # a recipe that does not generate
        parse_config(TrainingConfig, ["--config", str(config_file)])
    assert any("has no generation_backend" in p for p in refused.value.problems)
    config_file.write_text(base + "generation_backend: paged\ngather_weights_for_generation: false\n")
    with pytest.raises(ConfigError) as refused:
        parse_config(grpo, ["--config", str(config_file)])
    assert any("gather_weights_for_generation: true" in p for p in refused.value.problems)


def test_a_trl_grpo_config_generating_with_vllm_runs_unchanged(tmp_path):
    """TRL's vLLM keys as a TRL GRPO YAML sets them: use_vllm is the vllm backend, the vllm_* fields keep TRL's
    meaning, vllm_group_port is noted as ignored, vllm_importance_sampling_cap is read as _clip_max; on a recipe that
    does not generate, use_vllm: false is ignored and true refused."""
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train.config import TrainingConfig
    from helpers.recipes import load_recipe

    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(
        "model_name_or_path: org/model\ndataset_name: x.jsonl\nreward_funcs: [exact_match]\nuse_vllm: true\n"
        "vllm_mode: server\nvllm_server_host: 10.0.0.2\nvllm_server_port: 8001\nvllm_server_timeout: 120\n"
        "vllm_group_port: 51216\nvllm_gpu_memory_utilization: 0.3\nvllm_tensor_parallel_size: 1\n"
        "vllm_max_model_length: 2048\nvllm_enable_sleep_mode: false\nvllm_importance_sampling_correction: true\n"
        "vllm_importance_sampling_mode: token_truncate\nvllm_importance_sampling_cap: 2.0\n"
    )
    config = parse_config(load_recipe("grpo").GRPOConfig, ["--config", str(config_file)])
    assert config.generation_backend == "vllm" and config.vllm_base_url() == "http://10.0.0.2:8001"
    assert (config.vllm_server_timeout, config.vllm_importance_sampling_clip_max) == (120.0, 2.0)
    assert config.corrects_sampler() and config.vllm_importance_sampling_mode == "token_truncate"
    assert "ignored" in config.upstream_notes["vllm_group_port"] and "vllm" in config.upstream_notes["use_vllm"]
    for recipe in ("distill", "eval"):  # the same fields where the recipe generates
        assert "vllm_server_base_url" in {field.name for field in dataclasses.fields(load_recipe(recipe).__dict__[
            {"distill": "DistillConfig", "eval": "EvalConfig"}[recipe]])}  # fmt: skip
    sft_file = tmp_path / "sft.yaml"
    sft_file.write_text("model_name_or_path: org/model\ndataset_name: x.jsonl\nuse_vllm: false\n")
    assert "does not generate" in parse_config(TrainingConfig, ["--config", str(sft_file)]).upstream_notes["use_vllm"]
    sft_file.write_text("model_name_or_path: org/model\ndataset_name: x.jsonl\nuse_vllm: true\n")
    with pytest.raises(ConfigError) as refused:
        parse_config(TrainingConfig, ["--config", str(sft_file)])
    assert any("has no generation_backend" in problem for problem in refused.value.problems)
