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
from pathlib import Path
from typing import Any

from transformers import SchedulerType

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.models.adapters import adapter_config_problems
from fsdp_recipes.models.vision import VisionFields
from fsdp_recipes.train.benchmarks import BenchmarkFields
from fsdp_recipes.train.checkpoint import allow_config_change_problems
from fsdp_recipes.train.compilation import COMPILE_REPAID_AFTER_STEPS, compile_setting_problem
from fsdp_recipes.train.export_settings import PublishingFields
from fsdp_recipes.train.losses import LOSS_IMPLEMENTATIONS
from fsdp_recipes.train.preemption import check_signal_names
from fsdp_recipes.train.recipe_interface import RecipeTraits
from fsdp_recipes.train.trainer_arguments import RunCompatFields, TrainingCompatFields, check_warmup_steps


@dataclasses.dataclass
class RunConfig(BenchmarkFields, RunCompatFields):
    """The settings every recipe has, training or not (plus those named as in TrainingArguments/TRL: trainer_arguments)."""

    # --- model --------------------------------------------------------------------------------------------------------
    model_name_or_path: str | None = setting(None, "Hub id or local folder with pretrained weights", resume="sensitive")
    model_revision: str = setting("main", "Hub branch, tag or commit of model and tokenizer", resume="free")
    tokenizer_name_or_path: str | None = setting(
        None, "Hub id or local folder of the tokenizer (null: model_name_or_path)", resume="sensitive"
    )
    chat_template: str | None = setting(
        None, "Jinja text or a path to a .jinja file; overrides the tokenizer's own", resume="sensitive"
    )
    trust_remote_code: bool = setting(
        False, "runs Python code from the model repo: only for repos you trust", resume="free"
    )
    attn_implementation: str | None = setting(
        None,
        "null or auto: flex_attention for packed rows on a CUDA GPU where the model supports it, else sdpa, else "
        "eager (the run summary says which and why). sdpa, eager (slow, exact), flex_attention (CUDA for "
        "training; compiles its kernel at the first step), flash_attention_2/3 (GPU, needs flash-attn)",
        resume="free",
    )
    # --- data ---------------------------------------------------------------------------------------------------------
    dataset_name: str | None = setting(
        None, "Hub id, a local .json/.jsonl/.parquet/.csv file, or a folder of them", resume="sensitive"
    )
    dataset_config: str | None = setting(None, "Hub dataset configuration name", resume="sensitive")
    max_length: int = setting(1024, "tokens per example: longer ones are truncated", resume="sensitive")
    dataset_num_proc: int | None = setting(None, "processes for tokenisation (null: in-process)", resume="free")
    per_device_eval_batch_size: int = setting(
        8,
        "rows per process per forward pass on held-out data (and per generation batch); no "
        "gradients are kept, so it can often be larger than per_device_train_batch_size",
        resume="free",
        check=checks.at_least(1),
    )
    # --- outputs and tracking -----------------------------------------------------------------------------------------
    output_dir: str = setting(
        "outputs/run",
        "the run's folder: at the end the exported model (a peft adapter folder with use_peft), "
        "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    seed: int = setting(
        42,
        "seeds Python, NumPy and torch (model initialisation, dropout), the order rows are read in, and "
        "the held-out part carved out of train: same seed, same data order and initial weights",
        resume="sensitive",
    )
    # --- Hub ----------------------------------------------------------------------------------------------------------
    push_to_hub: bool = setting(
        False, "upload the exported folder at the end (needs a token: HF_TOKEN or `hf auth login`)", resume="free"
    )
    hub_model_id: str | None = setting(None, "the Hub repo to push to: user/name or org/name", resume="free")
    hub_private_repo: bool = setting(True, "create the repo private; flip for public releases", resume="free")

    def min_max_length(self) -> tuple[int, str]:
        """The fewest tokens one example of this recipe's format needs, and why: a smaller max_length is refused
        (a recipe whose format needs more overrides this)."""
        return 2, "a causal LM example needs one token to read and one to predict"

    def scores_without_data(self) -> bool:
        """Whether the recipe has work without `dataset_name` (eval.py with lm-eval tasks only): training needs data."""
        return False

    def validate(self) -> list[str]:
        """Every problem with the values (`common.checks.config_problems`): each field's declared check, then each
        settings group's `cross_field_problems`. Not overridden: a group states its rules in its own
        `cross_field_problems`, which runs whatever the other groups do."""
        return checks.config_problems(self)

    def cross_field_problems(self) -> list[str]:
        problems = []
        if not self.dataset_name and self.dataset_mixture is None and not self.scores_without_data():
            problems.append(
                "dataset_name is required: a Hub dataset id or a local .json/.jsonl/.parquet path (or a dataset_mixture)"
            )
        fewest, why = self.min_max_length()
        if self.max_length < fewest:
            problems.append(f"max_length must be >= {fewest} ({why}), got {self.max_length}")
        return problems


@dataclasses.dataclass
class TrainingConfig(PublishingFields, VisionFields, RunConfig, TrainingCompatFields, RecipeTraits):
    """The settings every training recipe has; each recipe subclasses it with the fields only it needs (its data
    format, its loss), states the rules between its fields in `cross_field_problems`, and overrides the methods below that describe it to the shared layer."""

    def __post_init__(self):
        if self.lora_target_modules == ["all-linear"]:  # peft's name for every linear layer (TRL configs use it)
            self.lora_target_modules = None  # which is what null means here

    # --- model --------------------------------------------------------------------------------------------------------
    model_config: str | None = setting(
        None,
        "instead of model_name_or_path: a config.json to initialise a model from scratch (demos, tests)",
        resume="sensitive",
    )
    router_aux_loss_coef: float | None = setting(
        None,
        "a mixture of experts' load-balancing loss weight (TRL's name): null keeps the model config's (on only where "
        "it sets output_router_logits: true); > 0 turns the loss on with this weight, 0 turns it off. Higher spreads "
        "tokens more evenly over the experts, at some cost to the task loss (docs/moe.md)",
        resume="sensitive",
        check=checks.at_least(0, or_null=True),
    )
    router_bias_update_rate: float | None = setting(
        None,
        "DeepSeek-V3's auxiliary-loss-free balancing (Megatron-LM's moe_router_bias_update_rate; torchtitan's "
        "load_balance_coeff): after each step, each router's e_score_correction_bias rises by this much for an expert "
        "the step's global batch chose less than the mean, falls for one chosen more (logged: moe/load_imbalance). "
        "null: DeepSeek-V3's 0.001 for DeepSeek-V3 (nothing for other models, nor under LoRA); 0 turns it off. "
        "Higher evens the loads faster but shifts routing more per step (docs/moe.md)",
        resume="sensitive",
        check=checks.at_least(0, or_null=True),
    )
    # --- LoRA / QLoRA (names as TRL's ModelConfig; see fsdp_recipes.models.adapters) ---------------------------------
    use_peft: bool = setting(
        False,
        "train LoRA adapters on a frozen base: a fraction of the gradients and optimizer state; "
        "output_dir becomes a peft adapter folder (needs pretrained weights: model_name_or_path)",
        resume="fixed",
    )
    lora_r: int = setting(16, "adapter rank: larger = more capacity, more trainable parameters", resume="fixed")
    lora_alpha: int = setting(
        32, "adapter scale is lora_alpha / lora_r (or / sqrt(lora_r) with use_rslora)", resume="sensitive"
    )
    lora_dropout: float = setting(0.05, "dropout on the adapters' input", resume="sensitive")
    lora_target_modules: list[str] | None = setting(
        None,
        "module names to adapt (null or [all-linear]: every linear layer of the decoder blocks, peft's all-linear)",
        resume="fixed",
    )
    lora_modules_to_save: list[str] | None = setting(
        None,
        "modules trained in full next to the adapters (e.g. lm_head); each costs its full gradients "
        "and optimizer state",
        resume="fixed",
    )
    use_rslora: bool = setting(False, "rank-stabilised scaling: helps when lora_r is large", resume="sensitive")
    use_dora: bool = setting(False, "weight-decomposed LoRA: often better quality, slower steps", resume="fixed")
    export_merged_model: bool = setting(
        False,
        "also write output_dir/merged: the base with the adapters merged in, a plain transformers "
        "model (needs the base model in memory on the main process at the end)",
        resume="free",
    )
    load_in_4bit: bool = setting(
        False, "QLoRA: base weights stored in 4 bits (bitsandbytes), ~4x less memory for them", resume="fixed"
    )
    bnb_4bit_quant_type: str = setting("nf4", "nf4 (QLoRA's) or fp4", resume="free")
    use_bnb_nested_quant: bool = setting(
        False, "quantise the quantisation constants too: ~0.4 bits per weight less", resume="free"
    )
    bnb_4bit_compute_dtype: str = setting(
        "bfloat16", "dtype the 4-bit weights are dequantised to for each matmul", resume="free"
    )
    bnb_4bit_quant_storage: str | None = setting(
        None,
        "dtype the packed 4-bit weights are stored in (null: the compute dtype). FSDP shards only "
        "floating dtypes: uint8 storage is refused under FSDP",
        resume="free",
    )
    # --- data ----------------------------------------------------------------------------------------------------
    dataset_train_split: str = setting("train", "the dataset split to train on", resume="sensitive")
    dataset_test_split: str | None = setting(
        "test", "held-out split; if the dataset lacks it, eval_split_size is carved out of train", resume="sensitive"
    )
    eval_split_size: float = setting(
        0.05,
        "fraction of train held out when there is no test split (0 disables eval)",
        resume="sensitive",
        check=checks.within(0, 1),
    )
    train_sampling_strategy: str = setting(
        "group_by_length",
        "group_by_length: rows of similar length share a batch (less padding); or random",
        resume="sensitive",
        check=checks.one_of(("group_by_length", "random")),
    )
    repeat_small_dataset: bool = setting(
        False,
        "train on data smaller than one optimizer step (per_device_train_batch_size x processes x "
        "gradient_accumulation_steps rows; pretraining: per process), every step repeating rows (noted in the run "
        "summary). false: refused, with the numbers",
        resume="free",
    )
    # --- training ------------------------------------------------------------------------------------------------
    overwrite_output_dir: bool = setting(
        False, "allow writing into a non-empty output_dir (its files may be replaced)", resume="free"
    )
    num_train_epochs: float = setting(
        1.0,
        "passes over the training data (fractions allowed); ignored when max_steps > 0",
        resume="free",
        check=checks.non_negative(),
    )
    max_steps: int = setting(-1, "optimizer steps; > 0 overrides num_train_epochs", resume="free")
    per_device_train_batch_size: int = setting(
        8, "rows per process per micro-step", resume="free", check=checks.at_least(1)
    )
    gradient_accumulation_steps: int = setting(
        1,
        "micro-steps per optimizer step: global batch = per_device_train_batch_size * processes * "
        "this; more steps, same memory",
        resume="free",
        check=checks.at_least(1),
    )
    learning_rate: float = setting(
        2e-5,
        "AdamW's peak learning rate, reached after warmup, then shaped by lr_scheduler_type",
        resume="free",
        check=checks.non_negative(),
    )
    weight_decay: float = setting(
        0.0,
        "AdamW weight decay, on weight matrices only (not on norms and biases)",
        resume="free",
        check=checks.non_negative(),
    )
    adam_beta1: float = setting(
        0.9, "AdamW's decay rate of the running mean of gradients (momentum)", resume="free", check=checks.within(0, 1)
    )
    adam_beta2: float = setting(
        0.999,
        "AdamW's decay rate of the running mean of squared gradients: lower adapts faster to a changing gradient scale",
        resume="free",
        check=checks.within(0, 1),
    )
    adam_epsilon: float = setting(
        1e-8, "added to AdamW's denominator for numerical stability", resume="free", check=checks.non_negative()
    )
    lr_scheduler_type: str = setting(
        "cosine",
        "any transformers SchedulerType: linear, cosine, constant_with_warmup, ...",
        resume="free",
        check=checks.one_of(scheduler.value for scheduler in SchedulerType),
    )
    warmup_ratio: float = setting(
        0.0,
        "fraction of steps spent warming up (ignored if warmup_steps > 0)",
        resume="free",
        check=checks.within(0, 1),
    )
    warmup_steps: float = setting(
        0,
        "warmup from 0 to learning_rate: >= 1 a number of optimizer steps, in (0, 1) a fraction of the "
        "run (transformers 5); > 0 overrides warmup_ratio",
        resume="free",
        check=check_warmup_steps,
    )
    max_grad_norm: float = setting(
        1.0,
        "gradient clipping; 0 disables it",
        resume="free",
        check=checks.non_negative(note=" (0 turns clipping off; a negative value is not a way to do that)"),
    )
    skip_nonfinite_steps: int = setting(
        0,
        "a step whose gradient norm is not finite (NaN/inf) stops the run, its update not applied (0); N: up to N "
        "such steps are skipped instead (no update; the batch is spent, the schedule moves on), and counted. "
        "Skipping hides a blow-up that usually needs a lower learning rate or cleaner data",
        resume="free",
        check=checks.at_least(0),
    )
    logging_steps: int = setting(
        10, "log every N steps; each logging step is a few small all-reduces", resume="free", check=checks.at_least(1)
    )
    eval_steps: int | None = setting(
        None,
        "evaluate every N steps (null: only at the end); each costs a pass over the eval data",
        resume="free",
        check=checks.at_least(1, or_null=True),
    )
    benchmark_steps: int | None = setting(
        None,
        "score benchmark_tasks every N optimizer steps, and at the end (null: at the end only); each pass costs "
        "its tasks' documents in forwards, split over the data-parallel ranks",
        resume="free",
        check=checks.at_least(1, or_null=True, note=" (a positive number of optimizer steps)"),
    )
    # --- speed and measurement -----------------------------------------------------------------------------------
    loss_implementation: str = setting(
        "chunked",
        "chunked: cross-entropy over chunks of tokens, never the whole micro-batch's fp32 logits "
        "(their share of activation memory drops ~tokens/loss_chunk_size-fold); full_logits: what most "
        "trainers do (more memory); liger: liger-kernel's fused kernel (CUDA, pip install liger-kernel); "
        "linear_cross_entropy: torch's own (torch >= 2.13; measured against chunked: docs/chunked-loss.md)",
        resume="free",
        check=checks.one_of(LOSS_IMPLEMENTATIONS),
    )
    loss_chunk_size: int = setting(
        1024,
        "tokens per chunk: larger = fewer, bigger matmuls; smaller = less memory",
        resume="free",
        check=checks.at_least(1),
    )
    optim: str = setting(
        "adamw_torch",
        "adamw_torch (foreach kernels) or adamw_torch_fused (one kernel per step: faster on GPU)",
        resume="free",
        check=checks.one_of(("adamw_torch", "adamw_torch_fused"), note=": the optimizers supported here"),
    )
    torch_compile: str = setting(
        "false",
        "true: compile each decoder layer (accelerate's regional compilation): faster steps after a compile pause in "
        "the first step (first_step_time_s in the final metrics); auto: on where the pause is repaid, a CUDA device "
        f"and a run not set below {COMPILE_REPAID_AFTER_STEPS} steps (max_steps), else off. The run summary says "
        "which and why",
        resume="free",
        check=compile_setting_problem,
        flag_value="true",
    )
    torch_compile_backend: str = setting(
        "inductor",
        "torch.compile's backend: inductor generates fused kernels; eager and aot_eager only trace (no speed-up: "
        "for checking that a model compiles and does not recompile)",
        resume="free",
        check=checks.one_of(("inductor", "eager", "aot_eager", "cudagraphs")),
    )
    torch_compile_mode: str | None = setting(
        None,
        "inductor's mode: null (default), reduce-overhead (CUDA graphs: less launch overhead, more memory), "
        "max-autotune (a longer compile for faster kernels), max-autotune-no-cudagraphs",
        resume="free",
        check=checks.one_of(("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), or_null=True),
    )
    gradient_checkpointing: bool = setting(
        False,
        "the model's own activation checkpointing: ~30%% more compute, far less activation memory; "
        "refused when the Accelerate config already enables fsdp_activation_checkpointing",
        resume="free",
    )
    dataloader_num_workers: int = setting(
        0,
        "worker processes collating batches; raise if data_wait_fraction is high",
        resume="free",
        check=checks.at_least(0),
    )
    peak_flops_per_device: float | None = setting(
        None, "for MFU on devices not in the table (e.g. 989e12 for an H100)", resume="free"
    )
    # --- checkpoints ---------------------------------------------------------------------------------------------
    save_steps: int | None = setting(
        500,
        "resumable checkpoint every N steps and at the end (null: none); each costs a write",
        resume="free",
        check=checks.at_least(1, or_null=True),
    )
    save_total_limit: int | None = setting(
        None,
        "keep only the newest K checkpoints (null: keep all); saves disk",
        resume="free",
        check=checks.at_least(1, or_null=True),
    )
    resume_from_checkpoint: str | None = setting(
        None,
        "latest (the newest in output_dir/checkpoints) or a checkpoint folder. Unset, a run that was preempted, "
        "or restarted by its launcher (--max_restarts, a requeued SLURM job), resumes from latest by itself",
        resume="free",
    )
    preemption_signals: list[str] = setting(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        help="signals that mean the job is about to be stopped: every rank finishes its step, all save a checkpoint, "
        "and the run exits with status 75 to be started again ([]: the signals' own default, which kills the run)",
        resume="free",
        check=check_signal_names,
    )
    allow_config_change: list[str] | None = setting(
        None,
        "resuming: fields that change the objective or the data (docs/errors.md) which may differ from "
        "the checkpoint's, e.g. --allow_config_change beta; recorded in metrics.jsonl. Without it such a change "
        "is refused",
        resume="free",
    )

    def cross_field_problems(self) -> list[str]:
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
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            problems.append("set max_steps > 0 or num_train_epochs > 0")
        problems.extend(adapter_config_problems(self))
        problems.extend(allow_config_change_problems(self))
        if self.push_to_hub and not self.hub_model_id:
            problems.append("push_to_hub needs hub_model_id, e.g. --hub_model_id your-name/your-model")
        if self.benchmark_steps is not None and not self.benchmark_tasks:
            problems.append("benchmark_steps is set but benchmark_tasks is not: name the lm-eval tasks to score")
        return problems


def config_to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)
