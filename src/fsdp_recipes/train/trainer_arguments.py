"""The settings people bring from `transformers.TrainingArguments`, TRL and alignment-handbook configs, under their
upstream names and meanings: the fields (two dataclasses `RunConfig` and `TrainingConfig` build on), their checks,
and what they turn into here (trackers, the precision check against the Accelerate config, the cadence of
`eval_strategy`/`save_strategy`/`logging_strategy`, the scheduler's arguments, warmup as a fraction). Keys with no
field (old names, settings that live elsewhere, no-ops) are read by `fsdp_recipes.common.key_translation`.
docs/coming-from-trl.md lists every key."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
from typing import Any

import torch
from transformers import get_scheduler
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.mixture import mixture_problems
from fsdp_recipes.train.cadence import Cadence

TRACKERS = ("tensorboard", "wandb", "trackio")
STRATEGIES = ("no", "steps", "epoch")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass
class RunCompatFields:
    """Fields every recipe has whose names and meanings are TrainingArguments' / TRL's / the handbook's."""

    report_to: str = setting(
        "tensorboard",
        "trackers, comma-separated (a YAML list also works): tensorboard, wandb, trackio; none for no "
        "tracker. Each costs an import and its writes",
        resume="free",
    )
    project: str | None = setting(
        None,
        "tracker project (wandb/trackio project, TensorBoard folder in output_dir); null: recipe name",
        resume="free",
    )
    run_name: str | None = setting(
        None, "the run's name in the trackers (null: output_dir's folder name)", resume="free"
    )
    log_level: str = setting(
        "passive",
        "main process's log level: debug, info, warning, error, critical; passive = info. Other "
        "processes always log warnings and errors only",
        resume="free",
        check=checks.one_of(LOG_LEVELS),
    )
    dataset_mixture: dict | None = setting(
        None,
        "instead of dataset_name, alignment-handbook's mixture: {datasets: [{id, config, split, columns, "
        "weight}], seed, test_split_size}; weight = fraction of that dataset kept (>1 repeats it). "
        "docs/coming-from-trl.md",
        resume="sensitive",
    )
    dtype: str | None = setting(
        None,
        "the base weights' dtype (torch_dtype is read as this): auto/null (the checkpoint's own), "
        "bfloat16, float16, float32. Training still keeps fp32 master weights; the Accelerate config's "
        "mixed_precision sets the compute dtype; the export is written in this dtype unless export_dtype says",
        resume="free",
        check=checks.one_of(DTYPES, or_null=True),
    )
    eos_token: str | None = setting(
        None, "the tokenizer's end token (must be in its vocabulary), e.g. <|im_end|>; null: its own", resume="free"
    )
    bf16: bool | None = setting(
        None,
        "bf16 mixed precision. Launched with an Accelerate config: must agree with its mixed_precision "
        "(checked); without one (python recipes/x.py): turns bf16 on. null: the Accelerate config decides",
        resume="free",
    )
    fp16: bool | None = setting(None, "fp16 mixed precision, checked like bf16 (GPU only)", resume="free")
    ddp_timeout: int = setting(
        1800,
        "seconds a process waits in a collective before the run fails: raise it when one rank does long "
        "work alone (tokenising a large dataset on the main process first)",
        resume="free",
        check=checks.at_least(1, note=" (seconds)"),
    )

    def trackers(self) -> list[str]:
        return [name.strip() for name in self.report_to.split(",") if name.strip() not in ("", "none")]

    def cross_field_problems(self) -> list[str]:
        problems = []
        names = [name.strip() for name in self.report_to.split(",")]
        if "none" in names and len(names) > 1:
            problems.append(f"report_to {self.report_to!r} names none and trackers: keep one or the other")
        for name in self.trackers():
            if name not in TRACKERS:
                problems.append(f"report_to {name!r} is not one of {', '.join(TRACKERS)}, none")
            elif importlib.util.find_spec(name) is None:
                problems.append(
                    f"report_to names {name!r} but the package is not installed: pip install {name}, or set "
                    "report_to: none"
                )
        if self.bf16 and self.fp16:
            problems.append("bf16 and fp16 are both true: choose one mixed precision")
        if self.dataset_mixture is not None:
            if getattr(self, "dataset_name", None):
                problems.append("set dataset_name or dataset_mixture, not both")
            problems.extend(mixture_problems(self.dataset_mixture))
        return problems


@dataclasses.dataclass
class TrainingCompatFields:
    """Training fields whose names and meanings are TrainingArguments' / TRL's."""

    eval_strategy: str = setting(
        "steps",
        "when held-out loss is measured: steps (every eval_steps, and at the end), epoch (each epoch's "
        "end), no (never, unless do_eval: then once at the end)",
        resume="free",
        check=checks.one_of(STRATEGIES),
    )
    do_eval: bool | None = setting(
        None, "false: no evaluation at all; true with eval_strategy no: once at the end (as scripts do)", resume="free"
    )
    save_strategy: str = setting(
        "steps",
        "when checkpoints are written: steps (every save_steps and at the end), epoch, or no",
        resume="free",
        check=checks.one_of(STRATEGIES),
    )
    logging_strategy: str = setting(
        "steps",
        "when step figures are logged: steps (every logging_steps), epoch, or no",
        resume="free",
        check=checks.one_of(STRATEGIES),
    )
    lr_scheduler_kwargs: dict | None = setting(
        None,
        "the scheduler's own arguments, checked against it before loading, e.g. {min_lr_rate: 0.1} for "
        "cosine_with_min_lr",
        resume="free",
    )
    gradient_checkpointing_kwargs: dict | None = setting(
        None,
        "passed to the model's gradient_checkpointing_enable (null: {use_reentrant: false}, which "
        "FSDP2 and LoRA need least care with)",
        resume="free",
    )
    use_liger_kernel: bool = setting(
        False,
        "liger-kernel's fused RMSNorm, rotary embedding and SwiGLU/GeGLU kernels patched into the model: less "
        "activation memory and faster steps on CUDA GPUs (pip install liger-kernel); refused elsewhere. The loss is "
        "loss_implementation's (liger: its fused linear cross-entropy)",
        resume="free",
    )

    def cross_field_problems(self) -> list[str]:
        return scheduler_problems(self.lr_scheduler_type, self.lr_scheduler_kwargs)

    def held_out_split_size(self) -> float:
        """The fraction carved out of train for held-out loss: none when nothing will be evaluated."""
        return self.eval_split_size if evaluates(self) else 0.0


def scheduler_problems(scheduler_type: str, kwargs: dict | None) -> list[str]:
    """`lr_scheduler_kwargs` checked against the scheduler before any weights load: names it does not take, and
    whatever the scheduler itself refuses when built on a throwaway optimizer (cosine_with_min_lr without min_lr)."""
    functions = {kind.value: function for kind, function in TYPE_TO_SCHEDULER_FUNCTION.items()}
    if scheduler_type not in functions:
        return []  # lr_scheduler_type's own check names the valid types
    kwargs = kwargs or {}
    parameters = inspect.signature(functions[scheduler_type]).parameters
    own = [name for name in parameters if name not in ("optimizer", "num_warmup_steps", "num_training_steps")]
    if "kwargs" not in parameters:
        unknown = sorted(set(kwargs) - set(own) | set(kwargs) & {"last_epoch"})
        if unknown:
            takes = ", ".join(name for name in own if name != "last_epoch") or "no arguments"
            return [f"lr_scheduler_kwargs {', '.join(unknown)}: {scheduler_type} takes {takes}"]
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        get_scheduler(
            scheduler_type, probe, num_warmup_steps=1, num_training_steps=10, scheduler_specific_kwargs=dict(kwargs)
        )
    except (TypeError, ValueError) as error:
        return [f"lr_scheduler_type {scheduler_type} with lr_scheduler_kwargs {kwargs}: {error}"]
    return []


def check_warmup_steps(name: str, value: float) -> str | None:
    """warmup_steps as transformers 5 reads it: a whole number of steps, or a fraction of the run below 1."""
    if math.isfinite(value) and value >= 0 and (value < 1 or value == int(value)):
        return None
    return f"{name} must be a whole number of steps or a fraction of the run in [0, 1), got {value}"


def warmup_steps(config, total_steps: int) -> int:
    """Warmup in optimizer steps: `warmup_steps` >= 1 is a count, in (0, 1) a fraction of the run (transformers 5);
    0 falls back to `warmup_ratio`."""
    if config.warmup_steps >= 1:
        return int(config.warmup_steps)
    return math.ceil((config.warmup_steps or config.warmup_ratio) * total_steps)


def evaluates(config) -> bool:
    return config.do_eval is not False and (config.eval_strategy != "no" or bool(config.do_eval))


def cadence(config, kind: str, *, total_steps: int, steps_per_epoch: int | None) -> Cadence:
    """When `kind` (logging, eval or save) is due, by its strategy: steps -> every *_steps and at the last step,
    epoch -> at each epoch's end (`steps_per_epoch` None, a stream without epochs: at the last step), no -> never."""
    every, at_last_step = cadence_every(config, kind, steps_per_epoch)
    return Cadence(every, total_steps, at_last_step=at_last_step)


def cadence_every(config, kind: str, steps_per_epoch: int | None) -> tuple[int | None, bool]:
    """(every how many optimizer steps, whether also at the last step) for `kind`."""
    strategy = {"logging": config.logging_strategy, "eval": config.eval_strategy, "save": config.save_strategy}[kind]
    if kind == "eval" and not evaluates(config):
        return None, False
    if strategy == "no":
        return None, kind == "eval"  # do_eval with eval_strategy no: once at the end
    if strategy == "epoch":
        return steps_per_epoch, True
    every = {"logging": config.logging_steps, "eval": config.eval_steps, "save": config.save_steps}[kind]
    return every, kind != "save" or every is not None


def precision_problem(config, launch_precision: str | None) -> str | None:
    """bf16/fp16 against the Accelerate config's mixed_precision (None: no Accelerate config in this launch)."""
    asked = "bf16" if config.bf16 else "fp16" if config.fp16 else None
    refused = [name for name in ("bf16", "fp16") if getattr(config, name) is False]
    computes = "bf16" if launch_precision == "fp8" else launch_precision  # fp8: what is not float8 runs in bf16
    if launch_precision is None or (asked is None and computes not in refused):
        return None
    if asked == launch_precision or (asked == "bf16" and launch_precision == "fp8"):  # fp8: the rest runs in bf16
        return None
    written = f"{asked}: true" if asked else f"{computes}: false"
    return (
        f"the config says {written} but the Accelerate config's mixed_precision is {launch_precision!r} "
        f"({'fp32' if launch_precision == 'no' else launch_precision}): make them agree — set mixed_precision: "
        f"{asked or 'no'} in the Accelerate YAML, or remove {written.split(':')[0]} from the config (the Accelerate "
        "config decides when it is absent)"
    )


def mixed_precision_without_launch_config(config) -> str | None:
    """The precision a run started without an Accelerate config gets from bf16/fp16 (Trainer's meaning)."""
    return "bf16" if config.bf16 else "fp16" if config.fp16 else None


def upstream_key_notes(config) -> dict[str, str]:
    """{key: note} for the run summary (listed once): upstream keys read under another name, or ignored and why."""
    return dict(getattr(config, "upstream_notes", {}) or {})


def tracker_options(config, name: str) -> dict[str, Any]:
    """`init_trackers` arguments: the project and each tracker's run name."""
    run_name = config.run_name or config.output_dir.rstrip("/").split("/")[-1]
    per_tracker = {"wandb": {"name": run_name}, "trackio": {"name": run_name}}
    return dict(
        project_name=config.project or name,
        init_kwargs={tracker: per_tracker[tracker] for tracker in config.trackers() if tracker in per_tracker},
    )


def set_eos_token(tokenizer, eos_token: str | None) -> None:
    """`eos_token` as the tokenizer's end token (what ends a completion, what generation stops at, what is exported);
    refused unless the vocabulary has it, since a new token would need a new embedding row."""
    if eos_token is None:
        return
    if eos_token not in tokenizer.get_vocab():
        raise ConfigError(
            f"eos_token {eos_token!r} is not a token of the tokenizer's vocabulary: give one it has (e.g. its own, "
            f"{tokenizer.eos_token!r}), or remove eos_token"
        )
    tokenizer.eos_token = eos_token
