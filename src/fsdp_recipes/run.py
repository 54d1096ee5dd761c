"""A training run, from the launch to the exported folder, for any recipe: what a recipe does not need to see.

    run = run_lib.start(config, name="sft")        accelerator, seed, every check that needs no weights (all ranks
                                                    together), tokenizer and model config
    ... data, model, accelerator.prepare ...
    batches, first_step = run.begin(model, train_loader, scheduler, total_steps=..., evaluator=...)
                                                    resume, run summary, metrics log, trackers; then the components
                                                    that decide their own cadence: run.metrics (logging),
                                                    run.evaluation (the recipe's evaluator), run.checkpoints (saves)
    ... the loop ...
    run.finish(model, results={...})               final metrics, curves, export (read back and compared), card, Hub

Nothing here knows a particular recipe: the recipe passes its name, its task (causal LM or sequence classification)
and its config, a `TrainingConfig` subclass.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, TorchDynamoPlugin, broadcast_object_list, gather_object, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.faults import inject_fault
from fsdp_recipes.common.outputs import output_dir_problem
from fsdp_recipes.common.tables import format_table
from fsdp_recipes.common.yaml_json import write_json
from fsdp_recipes.distributed.accelerator import build_accelerator, describe_run, launch_environment
from fsdp_recipes.distributed.collectives import on_every_rank_together, sum_over_ranks
from fsdp_recipes.distributed.launch_checks import check_launch_environment
from fsdp_recipes.models import adapter_export, adapters
from fsdp_recipes.models.modeling import (
    activation_checkpointing_mechanism,
    check_one_activation_checkpointing,
    check_packing_is_isolated,
    check_same_shapes,
    check_tokenizer_fits_model,
    count_non_embedding_parameters,
    load_model_config,
    load_tokenizer,
    resolve_attn_implementation,
    resolve_wrap_classes,
)
from fsdp_recipes.publish.export import export_model_folder, write_model_card
from fsdp_recipes.publish.hub import push_folder_to_hub, require_hub_token
from fsdp_recipes.publish.model_source import ModelSource
from fsdp_recipes.publish.model_source import resolve as resolve_model_source
from fsdp_recipes.publish.model_source import task_of as model_source_task
from fsdp_recipes.tools.estimator.live import estimate_for_run
from fsdp_recipes.train import checkpoint as checkpoints_lib
from fsdp_recipes.train.config import RunConfig, TrainingConfig, config_to_dict
from fsdp_recipes.train.evaluation import Evaluation, LossEvaluator, LossSum
from fsdp_recipes.train.loop import BatchStream
from fsdp_recipes.train.losses import loss_implementation_problem
from fsdp_recipes.train.metrics import (
    MetricsLog,
    StepLogger,
    device_name,
    held_state_bytes,
    numeric_fields,
    peak_flops_per_device,
    plot_training_curves,
)

T = TypeVar("T")


@dataclasses.dataclass
class StartedRun:
    """What every recipe has once `start` (or `start_evaluation`) has run its checks: the accelerator, the tokenizer
    and model config, and what the Accelerate config will do with the model."""

    config: RunConfig
    name: str
    task: str
    accelerator: Accelerator
    tokenizer: Any
    model_config: Any
    hub_token: str | None
    wrap_classes: list[str] | None
    attn_implementation: str
    attention_note: str

    def on_every_rank(self, step: Callable[[], T], *, main_process_first: bool = False, what: str | None = None) -> T:
        """Runs `step` on every rank; if it fails on one, it fails on all, with that rank's message (no rank is left
        waiting in a collective). `main_process_first`: e.g. to fill the datasets cache once. `what`: names the step,
        for a library's exception caused by the input (`fsdp_recipes.common.steps`)."""
        return on_every_rank_together(self.accelerator, step, main_process_first=main_process_first, what=what)

    def sum_over_ranks(self, value: float) -> float:
        """Collective: the sum of `value` over all ranks (e.g. the target tokens of a global batch)."""
        return sum_over_ranks(self.accelerator, value)


@dataclasses.dataclass
class EvaluationRun(StartedRun):
    """An evaluation's start: the model source (folder, Hub id, adapter or checkpoint) and where results go."""

    source: ModelSource
    output_dir: Path
    hub_model_id: str | None


@dataclasses.dataclass
class Run(StartedRun):
    """A training run: `begin` after `accelerator.prepare`, the loop, `finish`."""

    config: TrainingConfig
    checkpoint: Path | None
    config_changes: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # resumed: allowed, old -> new
    log: MetricsLog | None = None
    metrics: StepLogger | None = None
    evaluation: Evaluation | None = None
    checkpoints: checkpoints_lib.Checkpointer | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    total_steps: int = 0

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

    def fault_point(self, step: int) -> None:
        """Where FSDP_RECIPES_FAULT can kill or fail a rank after a step, to rehearse crashes; nothing otherwise."""
        inject_fault("after-step", step, self.accelerator.process_index)

    def loss_evaluator(self, model, rows, loss_sum: LossSum) -> LossEvaluator:
        """Held-out loss on `rows` (None: no held-out data) every `eval_steps` and at the end, for `begin`."""
        return LossEvaluator(
            self.accelerator,
            model,
            rows,
            loss_sum=loss_sum,
            every=self.config.eval_steps,
            batch_size=self.config.per_device_eval_batch_size,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def progress_bar(self, first_step: int) -> tqdm:
        return tqdm(
            total=self.total_steps, initial=first_step - 1, disable=not self.accelerator.is_main_process, desc=self.name
        )

    def begin(
        self,
        model,
        train_loader,
        scheduler,
        *,
        total_steps: int,
        evaluator: Evaluation | None = None,
        summary: dict[str, Any] | None = None,
        checkpoint_files: dict[str, str] | None = None,
    ) -> tuple[BatchStream, int]:
        """Collective, after `accelerator.prepare`. Restores the checkpoint (if resuming), writes the run summary,
        starts the metrics log and trackers, and sets up logging, evaluation and checkpoint cadence. Returns the
        batch stream at the right data position and the first optimizer step to run.

        `train_loader` is a prepared DataLoader (its position is progress.json's, valid on any world size), or a
        stream that keeps each rank's own position: it has BatchStream's `take`, `epoch` and `batches_into_epoch`
        plus `state_dict()`, which every checkpoint stores per rank; the recipe restores it (`read_rank_state`)
        before loading weights, so it is used here as it is. `checkpoint_files`: {name: text} kept in every
        checkpoint, committed with it (e.g. values computed before the first step that a resume needs)."""
        config, accelerator = self.config, self.accelerator
        self.total_steps = total_steps
        accelerator.register_for_checkpointing(scheduler)
        per_rank_stream = not isinstance(train_loader, DataLoader)
        batches, first_step = train_loader if per_rank_stream else BatchStream(accelerator, train_loader), 1
        if self.checkpoint is not None:
            progress = checkpoints_lib.load_checkpoint(accelerator, self.checkpoint)
            if not per_rank_stream:
                batches = BatchStream(
                    accelerator,
                    train_loader,
                    epoch=progress.epoch,
                    batches_into_epoch=progress.batches_into_epoch_for(
                        accelerator.num_processes, config.per_device_train_batch_size
                    ),
                )
            first_step = progress.step + 1

        adapters.register_generate_as_forward(model)
        self.summary = describe_run(accelerator, model, self.wrap_classes)
        rows = None if per_rank_stream else len(getattr(train_loader, "dataset", None) or [])
        if rows is not None and rows < self.global_batch_rows:  # allowed by repeat_small_dataset (else refused)
            self.summary["repeated_data"] = (
                f"{rows} training rows, fewer than one optimizer step takes "
                f"({self.global_batch_rows}): every step repeats rows"
            )
        self.summary.update(
            recipe=self.name,
            task=self.task,
            attn_implementation=self.attention_note,
            **(summary or {}),
            **adapters.parameter_counts(model),
            lora=adapters.describe(config),
            optimizer_steps=total_steps,
            global_batch_rows=self.global_batch_rows,
            activation_checkpointing=activation_checkpointing_mechanism(accelerator, config.gradient_checkpointing),
            torch_compile=config.torch_compile,
            optim=config.optim,
            device_name=device_name(accelerator.device),
            memory_estimate=estimate_for_run(
                accelerator,
                self.model_config,
                dataclasses.replace(config, attn_implementation=self.attn_implementation),
            ),
        )
        self.log = MetricsLog(
            config.output_dir,
            enabled=accelerator.is_main_process,
            printer=tqdm.write,
            tracker=lambda record: accelerator.log(numeric_fields(record), step=record["step"]),
        )
        if accelerator.is_main_process:
            Path(config.output_dir).mkdir(parents=True, exist_ok=True)
            self.log.start(resumed_step=first_step - 1 if self.resumed else None)
            write_json(Path(config.output_dir) / "run_summary.json", self.summary)
            accelerator.print("run summary:\n" + format_table(list(self.summary.items())))
        self._record_state_bytes_after_first_step(model, scheduler.optimizer)
        accelerator.init_trackers(self.name, config=numeric_fields(config_to_dict(config), keep_text=True))
        if self.resumed:
            changes = {"config_changes": self.config_changes} if self.config_changes else {}
            self.log.log(
                {
                    "step": first_step - 1,
                    "event": "resumed",
                    "checkpoint": str(self.checkpoint),
                    "world_size": accelerator.num_processes,
                    **changes,
                }
            )
            for name, (old, new) in self.config_changes.items():
                accelerator.print(f"warning: resumed with {name} {old!r} -> {new!r} (allow_config_change)")

        self.metrics = StepLogger(
            accelerator,
            self.log,
            every=config.logging_steps,
            total_steps=total_steps,
            model_config=self.model_config,
            non_embedding_parameters=count_non_embedding_parameters(accelerator.unwrap_model(model)),
            peak_flops=peak_flops_per_device(self.summary["device_name"], config.peak_flops_per_device),
        )
        self.evaluation = evaluator or Evaluation()
        self.evaluation.attach(log=self.log, total_steps=total_steps, pause=self.metrics.window.paused)
        self.checkpoints = checkpoints_lib.Checkpointer(
            accelerator,
            config.output_dir,
            every=config.save_steps,
            total_steps=total_steps,
            save_total_limit=config.save_total_limit,
            pause=self.metrics.window.paused,
            position=lambda step: checkpoints_lib.TrainingProgress(
                step=step,
                epoch=batches.epoch,
                batches_into_epoch=batches.batches_into_epoch,
                world_size=accelerator.num_processes,
                per_device_train_batch_size=config.per_device_train_batch_size,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                data_state_per_rank=per_rank_stream,
            ),
            rank_state=batches.state_dict if per_rank_stream else None,
            extra_files=checkpoint_files,
            model_files_writer=lambda folder: checkpoints_lib.write_model_files(
                folder,
                model_config=self.model_config,
                tokenizer=self.tokenizer,
                generation_config=getattr(accelerator.unwrap_model(model), "generation_config", None),
                recipe_config=config_to_dict(config),
                accelerate_config=self.accelerate_settings,
                run_info={"recipe": self.name, "task": self.task},
            ),
        )
        return batches, first_step

    def _record_state_bytes_after_first_step(self, model, optimizer) -> None:
        """After the first optimizer step (collective, as every rank steps), the run summary gets the bytes each rank
        really holds (`state_bytes_per_rank`) beside what the estimator predicted for it (`memory_estimate`)."""
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)

        def record(*_):
            hook.remove()
            held = held_state_bytes(model, torch_optimizer)
            self.summary["state_bytes_per_rank"] = (
                gather_object([held]) if self.accelerator.num_processes > 1 else [held]
            )
            if self.accelerator.is_main_process:
                write_json(Path(self.config.output_dir) / "run_summary.json", self.summary)

        hook = torch_optimizer.register_step_post_hook(record)

    @property
    def global_batch_rows(self) -> int:
        config = self.config
        return config.per_device_train_batch_size * self.accelerator.num_processes * config.gradient_accumulation_steps

    @property
    def accelerate_settings(self) -> dict[str, Any]:
        return {"launch_environment": launch_environment(), "resolved": self.summary}

    def measured_once(self, key: str, measure: Callable[[], float]) -> float | None:
        """A figure taken before training (e.g. accuracy of the untrained model): measured and logged at step 0 by a
        new run; a resumed run reads it from the main process's log instead of measuring a half-trained model."""
        if self.resumed:
            return (
                broadcast_object_list([self.log.first(key)])[0]
                if self.accelerator.num_processes > 1
                else self.log.first(key)
            )
        value = measure()
        self.log.log({"step": 0, key: value})
        return value

    def finish(self, model, *, results: dict[str, Any] | None = None, eval_results: list | None = None) -> Path | None:
        """Collective. Evaluates at the last step if that has not happened, prints the final metrics, draws the
        curves, exports the model folder (read back and compared), writes the card (with `eval_results`, a list of
        huggingface_hub EvalResults, as its model-index) and `eval_results.json`, pushes to the Hub. Returns the
        folder on the main process."""
        config, accelerator = self.config, self.accelerator
        self.evaluation.maybe_evaluate(self.total_steps)
        results = {key: value for key, value in (results or {}).items() if value is not None}
        final_metrics = {
            "train_loss": self.log.last("loss"),
            "eval_loss": self.log.last("eval_loss"),
            **results,
            **self.metrics.final_metrics(),
            "estimated_memory_gib_per_gpu": self.summary["memory_estimate"]["predicted_per_gpu_bytes"]["total"] / 2**30,
        }
        if accelerator.is_main_process:
            accelerator.print(
                "final metrics (speeds: means over logged windows after the first):\n"
                + format_table(list(final_metrics.items()))
            )
            plot_training_curves(self.log.records, Path(config.output_dir) / "training_curves.png")
        card = dict(
            recipe=self.name,
            recipe_config=config_to_dict(config),
            accelerate_config=self.accelerate_settings,
            metrics={key: value for key, value in final_metrics.items() if value is not None},
            base_model=config.model_name_or_path,
            dataset=config.dataset_name,
            hub_model_id=config.hub_model_id,
            eval_results=eval_results,
            task=self.task,
        )
        if adapters.is_adapter_model(accelerator.unwrap_model(model)):
            folder = adapter_export.export_adapter_folder(
                accelerator,
                model,
                self.tokenizer,
                config.output_dir,
                task=self.task,
                config=config,
                card_writer=lambda where, library: write_model_card(where, library_name=library, **card),
            )
        else:
            folder = export_model_folder(
                accelerator, model, self.tokenizer, config.output_dir, task=self.task, card=card
            )
        if accelerator.is_main_process:
            if results:
                write_json(folder / "eval_results.json", results)
            if config.push_to_hub:
                url = push_folder_to_hub(
                    folder, config.hub_model_id, token=self.hub_token, private=config.hub_private_repo
                )
                accelerator.print(f"pushed to the Hub: {url}")
            accelerator.print(f"model exported to {folder.resolve()}")
        accelerator.end_training()
        return folder


def start(config: TrainingConfig, *, name: str, task: str = "causal-lm") -> Run:
    """The accelerator for this launch (refusing launches that cannot give what was asked), the seed, and every
    check that needs no weights, run on all ranks together so that a problem stops all of them before anything
    expensive: the Accelerate config, the checkpoint to resume (same global batch, same model), output_dir, the Hub
    token, tokenizer and model config, the wrap classes, activation checkpointing, the attention implementation."""
    accelerator = accelerator_for(config, compile_layers=config.torch_compile)
    checks = on_every_rank_together(accelerator, lambda: _checks_before_loading(accelerator, config, task))
    return Run(config=config, name=name, task=task, accelerator=accelerator, **checks)


def start_evaluation(
    config: RunConfig, *, name: str, task: str | None = None, base_model_name_or_path: str | None = None
) -> EvaluationRun:
    """`start` for a recipe that loads a trained model to measure it: the same accelerator and checks before loading,
    on a model folder, Hub id, LoRA adapter folder or recipe checkpoint; `task` None: the model's own (a
    *ForSequenceClassification is a classifier). output_dir None: the model folder itself. `base_model_name_or_path`:
    a LoRA adapter's base, instead of the one it records."""
    accelerator = accelerator_for(config)

    def checks() -> dict[str, Any]:
        source = resolve_model_source(config.model_name_or_path, base_model_name_or_path=base_model_name_or_path)
        output_dir = config.output_dir or (str(source.local_folder) if source.local_folder else None)
        if output_dir is None:
            raise ConfigError(
                "output_dir is required when evaluating a Hub id or a checkpoint: the folder for the "
                "results and the card"
            )
        problem = output_dir_problem(output_dir, overwrite=True)
        hub_model_id = config.hub_model_id or (source.name if source.kind == "hub" else None)
        if config.push_to_hub and not hub_model_id:
            problem = problem or "push_to_hub needs hub_model_id: the repo whose card gets the results"
        if problem:
            raise ConfigError(problem)
        hub_token = require_hub_token() if config.push_to_hub else None
        # an adapter folder has no model config of its own (its base's applies) but carries the tokenizer it used
        tokenizer, model_config = load_model_files(
            config,
            source.config_files,
            tokenizer_name_or_path=source.files,
            model_setting="base_model_name_or_path" if source.kind == "adapter" else "model_name_or_path",
        )
        model_task = task or model_source_task(source, model_config)
        return dict(
            source=source,
            output_dir=Path(output_dir),
            hub_model_id=hub_model_id,
            hub_token=hub_token,
            tokenizer=tokenizer,
            model_config=model_config,
            task=model_task,
            **model_layout(accelerator, config, model_config, model_task),
        )

    started = on_every_rank_together(accelerator, checks)
    accelerator.project_configuration.set_directories(str(started["output_dir"]))  # trackers write beside results
    return EvaluationRun(config=config, name=name, accelerator=accelerator, **started)


def accelerator_for(config: RunConfig, *, compile_layers: bool = False) -> Accelerator:
    """The Accelerate config as exported checked (its errors stop every rank here, its warnings are printed), the
    accelerator built from it with the config's tracker, and the seed set."""
    launch_warnings = check_launch_environment()
    accelerator = build_accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=config.output_dir,
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if compile_layers else None,
    )
    set_seed(config.seed)
    for warning in launch_warnings:
        accelerator.print(f"warning: the Accelerate config: {warning.key}: {warning.message}")
    return accelerator


def load_model_files(
    config: RunConfig,
    model_name_or_path: str | None,
    model_config_file: str | None = None,
    *,
    tokenizer_name_or_path: str | None = None,
    model_setting: str = "model_name_or_path",
):
    """(tokenizer, model config) of the model to load, checked against each other; no weights. The tokenizer is the
    config's `tokenizer_name_or_path`, else `tokenizer_name_or_path`, else the model's own. `model_setting`: the field
    that named `model_name_or_path`, for messages."""
    tokenizer = load_tokenizer(
        config.tokenizer_name_or_path or tokenizer_name_or_path or model_name_or_path,
        revision=config.model_revision,
        trust_remote_code=config.trust_remote_code,
        chat_template=config.chat_template,
        setting="tokenizer_name_or_path" if config.tokenizer_name_or_path else "model_name_or_path",
    )
    model_config = load_model_config(
        model_name_or_path,
        model_config_file,
        revision=config.model_revision,
        trust_remote_code=config.trust_remote_code,
        setting=None if model_config_file else model_setting,
    )
    check_tokenizer_fits_model(tokenizer, model_config)
    return tokenizer, model_config


def model_layout(accelerator: Accelerator, config: RunConfig, model_config, task: str) -> dict[str, Any]:
    """What the Accelerate config will wrap (checked against the model) and the attention implementation to load."""
    wrap_classes = resolve_wrap_classes(
        accelerator, model_config, task=task, trust_remote_code=config.trust_remote_code
    )
    attn_implementation, attention_note = resolve_attn_implementation(
        model_config, config.attn_implementation, task=task, trust_remote_code=config.trust_remote_code
    )
    return dict(wrap_classes=wrap_classes, attn_implementation=attn_implementation, attention_note=attention_note)


def _checks_before_loading(accelerator: Accelerator, config: TrainingConfig, task: str) -> dict[str, Any]:
    checkpoint = None
    if config.resume_from_checkpoint:
        checkpoint = checkpoints_lib.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
        checkpoints_lib.read_progress(checkpoint).check_resumable(
            world_size=accelerator.num_processes,
            per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
    resuming_here = checkpoint is not None and Path(config.output_dir).resolve() in checkpoint.resolve().parents
    problem = output_dir_problem(config.output_dir, overwrite=config.overwrite_output_dir or resuming_here)
    problem = problem or checkpoints_lib.checkpoint_conflict(config.output_dir, checkpoint)
    if problem:
        raise ConfigError(problem)
    hub_token = require_hub_token() if config.push_to_hub else None
    tokenizer, model_config = load_model_files(config, config.model_name_or_path, config.model_config)
    if checkpoint is not None and checkpoints_lib.saved_model_config_path(checkpoint).is_file():
        saved = load_model_config(
            None, str(checkpoints_lib.saved_model_config_path(checkpoint)), trust_remote_code=config.trust_remote_code
        )
        check_same_shapes(saved, model_config, task=task, trust_remote_code=config.trust_remote_code)
    config_changes = {}
    if checkpoint is not None and checkpoints_lib.saved_recipe_config_path(checkpoint).is_file():
        saved_recipe = json.loads(checkpoints_lib.saved_recipe_config_path(checkpoint).read_text())
        config_changes = checkpoints_lib.check_resume_config(config, saved_recipe, checkpoint)
    if config.packs_examples():
        check_packing_is_isolated(model_config)
    layout = model_layout(accelerator, config, model_config, task)
    check_one_activation_checkpointing(accelerator, model_gradient_checkpointing=config.gradient_checkpointing)
    adapters.check_before_loading(
        config,
        model_config,
        task=task,
        is_fsdp=accelerator.distributed_type.value == "FSDP",
        trust_remote_code=config.trust_remote_code,
    )
    problem = loss_implementation_problem(config.loss_implementation, accelerator.device.type)
    if problem:
        raise ConfigError(problem)
    return dict(
        checkpoint=checkpoint,
        hub_token=hub_token,
        tokenizer=tokenizer,
        model_config=model_config,
        config_changes=config_changes,
        **layout,
    )
