"""Recipe configuration: a dataclass per recipe (a `TrainingConfig` subclass defined in the recipe), filled from a YAML file plus `--field value` overrides.

Every problem found is collected and reported together, before any model or data is touched. Field names follow
`transformers.TrainingArguments` / TRL `SFTConfig` where one exists, so a user's existing YAML mostly carries over.
FSDP settings are deliberately absent: they come from the Accelerate YAML given to `accelerate launch`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import types
import typing
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser, SchedulerType

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.yaml_json import load_yaml_mapping


@dataclasses.dataclass
class TrainingConfig:
    """The settings every training recipe has; each recipe subclasses it with the fields only it needs (its data
    format, its loss) and extends `validate`. Comments say what each knob trades."""

    # --- model (names as TRL's ModelConfig) -----------------------------------------------------------------------
    model_name_or_path: str | None = None  # Hub id or local folder with pretrained weights
    model_config: str | None = None  # instead: a config.json to initialise a model from scratch (demos, tests)
    model_revision: str = "main"  # Hub branch, tag or commit of model and tokenizer
    tokenizer_name_or_path: str | None = None  # defaults to model_name_or_path
    chat_template: str | None = None  # Jinja text or a path to a .jinja file; overrides the tokenizer's own
    trust_remote_code: bool = False  # runs Python code from the model repo: only for repos you trust
    attn_implementation: str | None = None  # null: sdpa where the model supports it, else eager (the run summary says
    # which). "eager" (slow, exact), "flash_attention_2" (GPU, needs flash-attn), "flex_attention"
    # --- LoRA / QLoRA (names as TRL's ModelConfig; see fsdp_recipes.models.adapters) --------------------------------------
    use_peft: bool = False  # train LoRA adapters on a frozen base: a fraction of the gradients and optimizer state,
    # output_dir becomes a peft adapter folder (needs pretrained weights: model_name_or_path)
    lora_r: int = 16  # adapter rank: larger = more capacity, more trainable parameters
    lora_alpha: int = 32  # adapter scale is lora_alpha / lora_r (or / sqrt(lora_r) with use_rslora)
    lora_dropout: float = 0.05  # dropout on the adapters' input
    lora_target_modules: list[str] | None = None  # module names to adapt (null: every linear layer of the decoder
    # blocks, peft's "all-linear")
    lora_modules_to_save: list[str] | None = None  # modules trained in full next to the adapters (e.g. [lm_head]);
    # each costs its full gradients and optimizer state
    use_rslora: bool = False  # rank-stabilised scaling: helps when lora_r is large
    use_dora: bool = False  # weight-decomposed LoRA: often better quality, slower steps
    export_merged_model: bool = False  # also write output_dir/merged: the base with the adapters merged in, a plain
    # transformers model (needs the base model in memory on the main process at the end)
    load_in_4bit: bool = False  # QLoRA: base weights stored in 4 bits (bitsandbytes), ~4x less memory for them
    bnb_4bit_quant_type: str = "nf4"  # nf4 (QLoRA's) or fp4
    use_bnb_nested_quant: bool = False  # quantise the quantisation constants too: ~0.4 bits per weight less
    bnb_4bit_compute_dtype: str = "bfloat16"  # dtype the 4-bit weights are dequantised to for each matmul
    bnb_4bit_quant_storage: str | None = None  # dtype the packed 4-bit weights are stored in (null: the compute
    # dtype). FSDP shards only floating dtypes: uint8 storage is refused under FSDP
    # --- data ----------------------------------------------------------------------------------------------------
    dataset_name: str | None = None  # Hub id, a local .json/.jsonl/.parquet/.csv file, or a folder of them
    dataset_config: str | None = None  # Hub dataset configuration name
    dataset_train_split: str = "train"
    dataset_test_split: str | None = "test"  # held-out split; if the dataset lacks it, eval_split_size is carved out
    eval_split_size: float = 0.05  # fraction of train held out when there is no test split (0 disables eval)
    max_length: int = 1024  # tokens per example: longer ones are truncated
    train_sampling_strategy: str = "group_by_length"  # rows of similar length share a batch (less padding) or "random"
    dataset_num_proc: int | None = None  # processes for tokenisation (None: in-process)
    # --- training ------------------------------------------------------------------------------------------------
    output_dir: str = "outputs/run"
    overwrite_output_dir: bool = False  # allow writing into a non-empty output_dir (its files may be replaced)
    seed: int = 42
    num_train_epochs: float = 1.0
    max_steps: int = -1  # optimizer steps; > 0 overrides num_train_epochs
    per_device_train_batch_size: int = 8  # rows per process per micro-step
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1  # global batch = per_device_train_batch_size * processes * this
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "cosine"  # any transformers SchedulerType: linear, cosine, constant_with_warmup, ...
    warmup_ratio: float = 0.0  # fraction of steps spent warming up (ignored if warmup_steps > 0)
    warmup_steps: int = 0
    max_grad_norm: float = 1.0  # gradient clipping; 0 disables it
    logging_steps: int = 10  # each logging step is a few small all-reduces
    eval_steps: int | None = None  # evaluate every N steps (None: only at the end); each costs a pass over eval data
    # --- speed and measurement -----------------------------------------------------------------------------------
    loss_implementation: str = "chunked"  # "chunked": cross-entropy over chunks of tokens, never the whole micro-batch's
    # fp32 logits (their share of activation memory drops ~tokens/loss_chunk_size-fold); "full_logits": what most trainers
    # do (more memory); "liger": liger-kernel's fused kernel (CUDA, pip install liger-kernel)
    loss_chunk_size: int = 1024  # tokens per chunk: larger = fewer, bigger matmuls; smaller = less memory
    optim: str = "adamw_torch"  # "adamw_torch" (foreach kernels) or "adamw_torch_fused" (one kernel per step: faster on GPU)
    torch_compile: bool = False  # compile each decoder layer: faster steps after a compile pause at start-up
    gradient_checkpointing: bool = False  # the model's own activation checkpointing: ~30% more compute, far less
    # activation memory; refused when the Accelerate config already enables fsdp_activation_checkpointing
    dataloader_num_workers: int = 0  # worker processes collating batches; raise if data_wait_fraction is high
    report_to: str = "tensorboard"  # Accelerate tracker: tensorboard, wandb, trackio, or none
    peak_flops_per_device: float | None = None  # for MFU on devices not in the table (e.g. 989e12 for an H100)
    # --- checkpoints ---------------------------------------------------------------------------------------------
    save_steps: int | None = 500  # resumable checkpoint every N steps and at the end (null: none); each costs a write
    save_total_limit: int | None = None  # keep only the newest K checkpoints (null: keep all); saves disk
    resume_from_checkpoint: str | None = None  # "latest" (in output_dir/checkpoints) or a checkpoint folder
    # --- Hub ---------------------------------------------------------------------------------------------------
    push_to_hub: bool = False  # upload the exported folder at the end (needs a token: HF_TOKEN or `hf auth login`)
    hub_model_id: str | None = None  # "user/name" or "org/name"
    hub_private_repo: bool = True  # create the repo private; flip for public releases

    # --- what the shared layer asks of a recipe ---------------------------------------------------------------------
    # A recipe's config class overrides these; nothing under src/ reads a field that only one recipe has.
    def row_length(self) -> int:
        """Tokens in one training row (what a row costs in activations; the estimator's sequence length)."""
        return self.max_length

    def micro_batch_rows(self) -> int:
        """Rows one process runs forward per micro-step (a preference pair is two rows)."""
        return self.per_device_train_batch_size

    def packs_examples(self) -> bool:
        """Whether a row holds several examples: they must not attend to each other (checked before loading)."""
        return False

    def frozen_model_copies(self) -> int:
        """Whole frozen copies of the model kept beside the trained one (a reference model), sharded like it."""
        return 0

    def memory_saving_alternatives(self) -> list[tuple[str, dict[str, Any]]]:
        """Changes to this config that save memory the shared layer cannot know of, as (description, {field: value})
        pairs; the description reads "what it saves: what it costs". The estimator suggests each (with its predicted
        total) when a launch does not fit, on top of the changes every recipe has (LoRA, a smaller micro-batch)."""
        return []

    def validate(self) -> list[str]:
        """Problems with the values themselves (no file system or network access). Subclasses extend the list."""
        problems = []
        if (self.model_name_or_path is None) == (self.model_config is None):
            problems.append(
                "set exactly one of model_name_or_path (pretrained weights) and model_config (initialise from a "
                "config.json)"
            )
        if self.model_config is not None and not Path(self.model_config).is_file():
            problems.append(f"model_config: no such file {self.model_config!r}")
        if self.model_config is not None and self.tokenizer_name_or_path is None:
            problems.append("model_config needs tokenizer_name_or_path: a model built from a config has no tokenizer")
        if not self.dataset_name:
            problems.append("dataset_name is required: a Hub dataset id or a local .json/.jsonl/.parquet path")
        for name in ("max_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm", "num_train_epochs",
                     "warmup_ratio", "eval_split_size"):
            value = getattr(self, name)
            if not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value}")
            elif value < 0:
                problems.append(f"{name} must be >= 0, got {value}" + (
                    " (0 turns clipping off; a negative value is not a way to do that)" if name == "max_grad_norm" else ""))
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.train_sampling_strategy not in ("group_by_length", "random"):
            problems.append(f"train_sampling_strategy {self.train_sampling_strategy!r} is not group_by_length or random")
        if self.loss_implementation not in ("chunked", "full_logits", "liger"):
            problems.append(f"loss_implementation {self.loss_implementation!r} is not chunked, full_logits or liger")
        if self.loss_chunk_size < 1:
            problems.append(f"loss_chunk_size must be >= 1, got {self.loss_chunk_size}")
        if self.optim not in ("adamw_torch", "adamw_torch_fused"):
            problems.append(f"optim {self.optim!r} is not supported: use adamw_torch or adamw_torch_fused")
        if self.report_to not in ("tensorboard", "wandb", "trackio", "none"):
            problems.append(f"report_to {self.report_to!r} is not one of tensorboard, wandb, trackio, none")
        elif self.report_to != "none" and importlib.util.find_spec(self.report_to) is None:
            problems.append(f"report_to is {self.report_to!r} but the package is not installed: pip install "
                            f"{self.report_to}, or set report_to: none")
        if self.dataloader_num_workers < 0:
            problems.append(f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        for name in ("save_steps", "save_total_limit", "eval_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            problems.append("set max_steps > 0 or num_train_epochs > 0")
        if self.warmup_ratio >= 1:
            problems.append(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.eval_split_size >= 1:
            problems.append(f"eval_split_size must be in [0, 1), got {self.eval_split_size}")
        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            problems.append(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of {', '.join(schedulers)}")
        from fsdp_recipes.models.adapters import adapter_config_problems  # noqa: PLC0415 (adapters imports peft)

        problems.extend(adapter_config_problems(self))
        if self.push_to_hub and not self.hub_model_id:
            problems.append("push_to_hub needs hub_model_id, e.g. --hub_model_id your-name/your-model")
        return problems


def _field_kinds(cls) -> dict[str, tuple[type, bool]]:
    """field name -> (base type, accepts None)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            base = next(a for a in args if a is not type(None))
            kinds[field.name] = (base, type(None) in args)
        else:
            kinds[field.name] = (hint, False)
    return kinds


def _coerce(value: Any, base: type, nullable: bool) -> Any:
    """YAML value -> field type. YAML reads `1e-5` as a string, so numbers written that way are converted."""
    if value is None:
        if nullable:
            return None
        raise ValueError("may not be null")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, e.g. [{value!r}], got {value!r}")
        return [_coerce(item, typing.get_args(base)[0], False) for item in value]
    if base is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return str(value)
    return value


def _unknown_key_message(key: str, valid: list[str], where: str) -> str:
    if key.startswith("fsdp") or key in ("mixed_precision", "num_processes", "distributed_type"):
        return (
            f"{key!r} in {where} is an Accelerate setting: FSDP and precision settings live only in the Accelerate "
            "config (accelerate launch --config_file accelerate_configs/<topology>.yaml); remove it here"
        )
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; run with --help to list the valid ones"
    return f"unknown key {key!r} in {where}{hint}"


def parse_config(cls, argv: list[str] | None = None):
    """`--config FILE` plus `--field value` overrides -> a validated `cls` instance, or ConfigError listing all
    problems. Command-line values win over the file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    file_values = load_yaml_mapping(known.config) if known.config else {}
    where = f"config file {known.config!r}"

    kinds = _field_kinds(cls)
    problems, defaults = [], {}
    for key, value in file_values.items():
        if key not in kinds:
            problems.append(_unknown_key_message(key, list(kinds), where))
            continue
        try:
            defaults[key] = _coerce(value, *kinds[key])
        except ValueError as err:
            problems.append(f"{key} in {where}: {err}")

    rest, null_overrides = _take_null_overrides(rest, kinds)
    parser = HfArgumentParser(cls, allow_abbrev=False)  # --max_step must not silently mean --max_steps
    parser.add_argument("--config", help="YAML file with the recipe's settings; command-line flags override it")
    parser.set_defaults(**defaults)
    try:
        *parsed, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    except SystemExit as err:  # argparse already printed what was wrong with the value
        if err.code == 0:  # --help
            raise
        raise ConfigError("invalid command-line value (see the message above)") from None
    previous_was_flag = False
    for arg in remaining:
        if arg.startswith("--"):
            problems.append(_unknown_key_message(arg[2:].split("=")[0], list(kinds), "the command line"))
            previous_was_flag = "=" not in arg
        elif not previous_was_flag:  # a value right after an unknown flag is that flag's value
            problems.append(f"unexpected command-line argument {arg!r}: flags take the form --field value")
        else:
            previous_was_flag = False
    config = dataclasses.replace(parsed[0], **null_overrides)
    if not problems:
        problems.extend(config.validate())
    if problems:
        raise ConfigError(problems)
    return config


def _take_null_overrides(argv: list[str], kinds) -> tuple[list[str], dict[str, None]]:
    """`--save_steps null` (or none) on the command line sets a nullable field to None, as `null` does in YAML."""
    kept, nulls, index = [], {}, 0
    while index < len(argv):
        name = argv[index][2:] if argv[index].startswith("--") else None
        if (name in kinds and kinds[name][1] and index + 1 < len(argv)
                and argv[index + 1].lower() in ("null", "none")):
            nulls[name] = None
            index += 2
            continue
        kept.append(argv[index])
        index += 1
    return kept, nulls


def config_to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)
