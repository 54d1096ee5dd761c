"""The settings of a recipe: `RunConfig`, what every recipe has (the model, the data, outputs, trackers, the Hub;
eval.py's config builds on it), and `TrainingConfig`, what every training recipe adds. A recipe subclasses one of them
in its own file with the fields only it needs, and `fsdp_recipes.common.arguments.parse_config` fills it from a YAML
file plus `--field value` flags.

Field names follow `transformers.TrainingArguments` and TRL's configs where one exists, so a user's YAML mostly carries
over. FSDP settings are deliberately absent: they come from the Accelerate YAML given to `accelerate launch`. Each
field's help (`--help`) says what the knob trades.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from transformers import SchedulerType

from fsdp_recipes.models.adapters import adapter_config_problems
from fsdp_recipes.train.checkpoint import allow_config_change_problems
from fsdp_recipes.train.compat import RunCompatFields, TrainingCompatFields
from fsdp_recipes.train.losses import LOSS_IMPLEMENTATIONS
from fsdp_recipes.train.publishing import PublishingFields
from fsdp_recipes.train.recipe_traits import RecipeTraits


@dataclasses.dataclass
class RunConfig(RunCompatFields):
    """The settings every recipe has, training or not (plus those named as in TrainingArguments/TRL: compat)."""

    # --- model --------------------------------------------------------------------------------------------------------
    model_name_or_path: str | None = dataclasses.field(
        default=None, metadata={"resume": "sensitive", "help": "Hub id or local folder with pretrained weights"}
    )
    model_revision: str = dataclasses.field(
        default="main", metadata={"resume": "free", "help": "Hub branch, tag or commit of model and tokenizer"}
    )
    tokenizer_name_or_path: str | None = dataclasses.field(
        default=None,
        metadata={"resume": "sensitive", "help": "Hub id or local folder of the tokenizer (null: model_name_or_path)"},
    )
    chat_template: str | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "sensitive",
            "help": "Jinja text or a path to a .jinja file; overrides the tokenizer's own",
        },
    )
    trust_remote_code: bool = dataclasses.field(
        default=False,
        metadata={"resume": "free", "help": "runs Python code from the model repo: only for repos you trust"},
    )
    attn_implementation: str | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "free",
            "help": "null: sdpa where the model supports it, else eager (the run summary says which). eager (slow, "
            "exact), flash_attention_2 (GPU, needs flash-attn), flex_attention",
        },
    )
    # --- data ---------------------------------------------------------------------------------------------------------
    dataset_name: str | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "sensitive",
            "help": "Hub id, a local .json/.jsonl/.parquet/.csv file, or a folder of them",
        },
    )
    dataset_config: str | None = dataclasses.field(
        default=None, metadata={"resume": "sensitive", "help": "Hub dataset configuration name"}
    )
    max_length: int = dataclasses.field(
        default=1024, metadata={"resume": "sensitive", "help": "tokens per example: longer ones are truncated"}
    )
    dataset_num_proc: int | None = dataclasses.field(
        default=None, metadata={"resume": "free", "help": "processes for tokenisation (null: in-process)"}
    )
    per_device_eval_batch_size: int = dataclasses.field(
        default=8,
        metadata={
            "resume": "free",
            "help": "rows per process per forward pass on held-out data (and per generation batch); no "
            "gradients are kept, so it can often be larger than per_device_train_batch_size",
        },
    )
    # --- outputs and tracking -----------------------------------------------------------------------------------------
    output_dir: str = dataclasses.field(
        default="outputs/run",
        metadata={
            "resume": "free",
            "help": "the run's folder: at the end the exported model (a peft adapter folder with use_peft), "
            "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        },
    )
    seed: int = dataclasses.field(
        default=42,
        metadata={
            "resume": "sensitive",
            "help": "seeds Python, NumPy and torch (model initialisation, dropout), the order rows are read in, and "
            "the held-out part carved out of train: same seed, same data order and initial weights",
        },
    )
    # --- Hub ----------------------------------------------------------------------------------------------------------
    push_to_hub: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "free",
            "help": "upload the exported folder at the end (needs a token: HF_TOKEN or `hf auth login`)",
        },
    )
    hub_model_id: str | None = dataclasses.field(
        default=None, metadata={"resume": "free", "help": "the Hub repo to push to: user/name or org/name"}
    )
    hub_private_repo: bool = dataclasses.field(
        default=True, metadata={"resume": "free", "help": "create the repo private; flip for public releases"}
    )

    def min_max_length(self) -> tuple[int, str]:
        """The fewest tokens one example of this recipe's format needs, and why: a smaller max_length is refused
        (a recipe whose format needs more overrides this)."""
        return 2, "a causal LM example needs one token to read and one to predict"

    def validate(self) -> list[str]:
        """Problems with the values themselves (no file system or network access). Subclasses extend the list."""
        problems = self.run_compat_problems()
        if not self.dataset_name and self.dataset_mixture is None:
            problems.append(
                "dataset_name is required: a Hub dataset id or a local .json/.jsonl/.parquet path (or a dataset_mixture)"
            )
        fewest, why = self.min_max_length()
        if self.max_length < fewest:
            problems.append(f"max_length must be >= {fewest} ({why}), got {self.max_length}")
        if self.per_device_eval_batch_size < 1:
            problems.append(f"per_device_eval_batch_size must be >= 1, got {self.per_device_eval_batch_size}")
        return problems


@dataclasses.dataclass
class TrainingConfig(PublishingFields, RunConfig, TrainingCompatFields, RecipeTraits):
    """The settings every training recipe has; each recipe subclasses it with the fields only it needs (its data
    format, its loss), extends `validate`, and overrides the methods below that describe it to the shared layer."""

    # --- model --------------------------------------------------------------------------------------------------------
    model_config: str | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "sensitive",
            "help": "instead of model_name_or_path: a config.json to initialise a model from scratch (demos, tests)",
        },
    )
    # --- LoRA / QLoRA (names as TRL's ModelConfig; see fsdp_recipes.models.adapters) ---------------------------------
    use_peft: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "fixed",
            "help": "train LoRA adapters on a frozen base: a fraction of the gradients and optimizer state; "
            "output_dir becomes a peft adapter folder (needs pretrained weights: model_name_or_path)",
        },
    )
    lora_r: int = dataclasses.field(
        default=16,
        metadata={"resume": "fixed", "help": "adapter rank: larger = more capacity, more trainable parameters"},
    )
    lora_alpha: int = dataclasses.field(
        default=32,
        metadata={
            "resume": "sensitive",
            "help": "adapter scale is lora_alpha / lora_r (or / sqrt(lora_r) with use_rslora)",
        },
    )
    lora_dropout: float = dataclasses.field(
        default=0.05, metadata={"resume": "sensitive", "help": "dropout on the adapters' input"}
    )
    lora_target_modules: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "fixed",
            "help": "module names to adapt (null: every linear layer of the decoder blocks, peft's all-linear)",
        },
    )
    lora_modules_to_save: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "fixed",
            "help": "modules trained in full next to the adapters (e.g. lm_head); each costs its full gradients "
            "and optimizer state",
        },
    )
    use_rslora: bool = dataclasses.field(
        default=False, metadata={"resume": "sensitive", "help": "rank-stabilised scaling: helps when lora_r is large"}
    )
    use_dora: bool = dataclasses.field(
        default=False,
        metadata={"resume": "fixed", "help": "weight-decomposed LoRA: often better quality, slower steps"},
    )
    export_merged_model: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "free",
            "help": "also write output_dir/merged: the base with the adapters merged in, a plain transformers "
            "model (needs the base model in memory on the main process at the end)",
        },
    )
    load_in_4bit: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "fixed",
            "help": "QLoRA: base weights stored in 4 bits (bitsandbytes), ~4x less memory for them",
        },
    )
    bnb_4bit_quant_type: str = dataclasses.field(
        default="nf4", metadata={"resume": "free", "help": "nf4 (QLoRA's) or fp4"}
    )
    use_bnb_nested_quant: bool = dataclasses.field(
        default=False,
        metadata={"resume": "free", "help": "quantise the quantisation constants too: ~0.4 bits per weight less"},
    )
    bnb_4bit_compute_dtype: str = dataclasses.field(
        default="bfloat16",
        metadata={"resume": "free", "help": "dtype the 4-bit weights are dequantised to for each matmul"},
    )
    bnb_4bit_quant_storage: str | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "free",
            "help": "dtype the packed 4-bit weights are stored in (null: the compute dtype). FSDP shards only "
            "floating dtypes: uint8 storage is refused under FSDP",
        },
    )
    # --- data ----------------------------------------------------------------------------------------------------
    dataset_train_split: str = dataclasses.field(
        default="train", metadata={"resume": "sensitive", "help": "the dataset split to train on"}
    )
    dataset_test_split: str | None = dataclasses.field(
        default="test",
        metadata={
            "resume": "sensitive",
            "help": "held-out split; if the dataset lacks it, eval_split_size is carved out of train",
        },
    )
    eval_split_size: float = dataclasses.field(
        default=0.05,
        metadata={
            "resume": "sensitive",
            "help": "fraction of train held out when there is no test split (0 disables eval)",
        },
    )
    train_sampling_strategy: str = dataclasses.field(
        default="group_by_length",
        metadata={
            "resume": "sensitive",
            "help": "group_by_length: rows of similar length share a batch (less padding); or random",
        },
    )
    repeat_small_dataset: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "free",
            "help": "train on data smaller than one optimizer step (per_device_train_batch_size x processes x "
            "gradient_accumulation_steps rows; pretraining: per process), every step repeating rows (noted in the run "
            "summary). false: refused, with the numbers",
        },
    )
    # --- training ------------------------------------------------------------------------------------------------
    overwrite_output_dir: bool = dataclasses.field(
        default=False,
        metadata={"resume": "free", "help": "allow writing into a non-empty output_dir (its files may be replaced)"},
    )
    num_train_epochs: float = dataclasses.field(
        default=1.0,
        metadata={
            "resume": "free",
            "help": "passes over the training data (fractions allowed); ignored when max_steps > 0",
        },
    )
    max_steps: int = dataclasses.field(
        default=-1, metadata={"resume": "free", "help": "optimizer steps; > 0 overrides num_train_epochs"}
    )
    per_device_train_batch_size: int = dataclasses.field(
        default=8, metadata={"resume": "free", "help": "rows per process per micro-step"}
    )
    gradient_accumulation_steps: int = dataclasses.field(
        default=1,
        metadata={
            "resume": "free",
            "help": "micro-steps per optimizer step: global batch = per_device_train_batch_size * processes * "
            "this; more steps, same memory",
        },
    )
    learning_rate: float = dataclasses.field(
        default=2e-5,
        metadata={
            "resume": "free",
            "help": "AdamW's peak learning rate, reached after warmup, then shaped by lr_scheduler_type",
        },
    )
    weight_decay: float = dataclasses.field(
        default=0.0,
        metadata={"resume": "free", "help": "AdamW weight decay, on weight matrices only (not on norms and biases)"},
    )
    adam_beta1: float = dataclasses.field(
        default=0.9,
        metadata={"resume": "free", "help": "AdamW's decay rate of the running mean of gradients (momentum)"},
    )
    adam_beta2: float = dataclasses.field(
        default=0.999,
        metadata={
            "resume": "free",
            "help": "AdamW's decay rate of the running mean of squared gradients: lower adapts faster to a "
            "changing gradient scale",
        },
    )
    adam_epsilon: float = dataclasses.field(
        default=1e-8, metadata={"resume": "free", "help": "added to AdamW's denominator for numerical stability"}
    )
    lr_scheduler_type: str = dataclasses.field(
        default="cosine",
        metadata={
            "resume": "free",
            "help": "any transformers SchedulerType: linear, cosine, constant_with_warmup, ...",
        },
    )
    warmup_ratio: float = dataclasses.field(
        default=0.0,
        metadata={"resume": "free", "help": "fraction of steps spent warming up (ignored if warmup_steps > 0)"},
    )
    warmup_steps: float = dataclasses.field(
        default=0,
        metadata={
            "resume": "free",
            "help": "warmup from 0 to learning_rate: >= 1 a number of optimizer steps, in (0, 1) a fraction of the "
            "run (transformers 5); > 0 overrides warmup_ratio",
        },
    )
    max_grad_norm: float = dataclasses.field(
        default=1.0, metadata={"resume": "free", "help": "gradient clipping; 0 disables it"}
    )
    logging_steps: int = dataclasses.field(
        default=10,
        metadata={"resume": "free", "help": "log every N steps; each logging step is a few small all-reduces"},
    )
    eval_steps: int | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "free",
            "help": "evaluate every N steps (null: only at the end); each costs a pass over the eval data",
        },
    )
    # --- speed and measurement -----------------------------------------------------------------------------------
    loss_implementation: str = dataclasses.field(
        default="chunked",
        metadata={
            "resume": "free",
            "help": "chunked: cross-entropy over chunks of tokens, never the whole micro-batch's fp32 logits "
            "(their share of activation memory drops ~tokens/loss_chunk_size-fold); full_logits: what most "
            "trainers do (more memory); liger: liger-kernel's fused kernel (CUDA, pip install liger-kernel); "
            "linear_cross_entropy: torch's own (torch >= 2.13; measured against chunked: docs/chunked-loss.md)",
        },
    )
    loss_chunk_size: int = dataclasses.field(
        default=1024,
        metadata={"resume": "free", "help": "tokens per chunk: larger = fewer, bigger matmuls; smaller = less memory"},
    )
    optim: str = dataclasses.field(
        default="adamw_torch",
        metadata={
            "resume": "free",
            "help": "adamw_torch (foreach kernels) or adamw_torch_fused (one kernel per step: faster on GPU)",
        },
    )
    torch_compile: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "free",
            "help": "compile each decoder layer: faster steps after a compile pause at start-up",
        },
    )
    gradient_checkpointing: bool = dataclasses.field(
        default=False,
        metadata={
            "resume": "free",
            "help": "the model's own activation checkpointing: ~30%% more compute, far less activation memory; "
            "refused when the Accelerate config already enables fsdp_activation_checkpointing",
        },
    )
    dataloader_num_workers: int = dataclasses.field(
        default=0,
        metadata={"resume": "free", "help": "worker processes collating batches; raise if data_wait_fraction is high"},
    )
    peak_flops_per_device: float | None = dataclasses.field(
        default=None,
        metadata={"resume": "free", "help": "for MFU on devices not in the table (e.g. 989e12 for an H100)"},
    )
    # --- checkpoints ---------------------------------------------------------------------------------------------
    save_steps: int | None = dataclasses.field(
        default=500,
        metadata={
            "resume": "free",
            "help": "resumable checkpoint every N steps and at the end (null: none); each costs a write",
        },
    )
    save_total_limit: int | None = dataclasses.field(
        default=None,
        metadata={"resume": "free", "help": "keep only the newest K checkpoints (null: keep all); saves disk"},
    )
    resume_from_checkpoint: str | None = dataclasses.field(
        default=None,
        metadata={"resume": "free", "help": "latest (the newest in output_dir/checkpoints) or a checkpoint folder"},
    )
    allow_config_change: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "resume": "free",
            "help": "resuming: fields that change the objective or the data (docs/errors.md) which may differ from "
            "the checkpoint's, e.g. --allow_config_change beta; recorded in metrics.jsonl. Without it such a change "
            "is refused",
        },
    )

    def validate(self) -> list[str]:
        problems = super().validate() + self.training_compat_problems()
        if (self.model_name_or_path is None) == (self.model_config is None):
            problems.append(
                "set exactly one of model_name_or_path (pretrained weights) and model_config (initialise from a "
                "config.json)"
            )
        if self.model_config is not None and not Path(self.model_config).is_file():
            problems.append(f"model_config: no such file {self.model_config!r}")
        if self.model_config is not None and self.tokenizer_name_or_path is None:
            problems.append("model_config needs tokenizer_name_or_path: a model built from a config has no tokenizer")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "learning_rate",
            "weight_decay",
            "adam_epsilon",
            "max_grad_norm",
            "num_train_epochs",
            "warmup_ratio",
            "eval_split_size",
        ):
            value = getattr(self, name)
            if not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value}")
            elif value < 0:
                problems.append(
                    f"{name} must be >= 0, got {value}"
                    + (
                        " (0 turns clipping off; a negative value is not a way to do that)"
                        if name == "max_grad_norm"
                        else ""
                    )
                )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.train_sampling_strategy not in ("group_by_length", "random"):
            problems.append(
                f"train_sampling_strategy {self.train_sampling_strategy!r} is not group_by_length or random"
            )
        if self.loss_implementation not in LOSS_IMPLEMENTATIONS:
            problems.append(f"loss_implementation {self.loss_implementation!r} is not one of {LOSS_IMPLEMENTATIONS}")
        if self.loss_chunk_size < 1:
            problems.append(f"loss_chunk_size must be >= 1, got {self.loss_chunk_size}")
        if self.optim not in ("adamw_torch", "adamw_torch_fused"):
            problems.append(f"optim {self.optim!r} is not supported: use adamw_torch or adamw_torch_fused")
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
        problems.extend(adapter_config_problems(self))
        problems.extend(allow_config_change_problems(self))
        if self.push_to_hub and not self.hub_model_id:
            problems.append("push_to_hub needs hub_model_id, e.g. --hub_model_id your-name/your-model")
        return problems


def config_to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)
