"""The objects a recipe drives: `StartedRun` (what `start` checked and built), `EvaluationRun` (an evaluation's
start) and `Run` (a training run whose `begin`, after `accelerator.prepare`, returns the loop's `Training`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from fsdp_recipes.common.faults import inject_fault
from fsdp_recipes.common.tables import format_table
from fsdp_recipes.common.yaml_json import write_json
from fsdp_recipes.distributed import logs, tensor_parallel
from fsdp_recipes.distributed.accelerator import describe_run, launch_environment
from fsdp_recipes.distributed.collectives import on_every_rank_together, sum_tensor_over_ranks, values_of_all_ranks
from fsdp_recipes.models import adapter_export, adapters, experts, fused_kernels
from fsdp_recipes.models.export_dtype import dtype_name, recipe_dtype_override, resolve_export_dtype
from fsdp_recipes.models.modeling import (
    activation_checkpointing_mechanism,
    checkpoint_lacks_task_weights,
    count_non_embedding_parameters,
    load_model,
)
from fsdp_recipes.publish.export import export_model_folder, write_model_card
from fsdp_recipes.publish.hub import push_folder_to_hub
from fsdp_recipes.publish.model_source import ModelSource
from fsdp_recipes.run.training import Training
from fsdp_recipes.tools.estimator.live import estimate_for_run
from fsdp_recipes.train import checkpoint as checkpoints_lib
from fsdp_recipes.train import compat, loop
from fsdp_recipes.train.config import RunConfig, TrainingConfig, config_to_dict
from fsdp_recipes.train.evaluation import Evaluation, LossEvaluator, LossSum
from fsdp_recipes.train.loop import BatchStream
from fsdp_recipes.train.metrics import (
    MetricsLog,
    StepLogger,
    device_name,
    held_state_bytes,
    numeric_fields,
    peak_flops_per_device,
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

    def sum_over_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """Collective: the sum of `value` (a tensor or a number) over the data-parallel ranks, e.g. the target tokens
        of a global batch: a float64 tensor on the device, never read here, so the step does not wait for it."""
        if isinstance(value, torch.Tensor):
            total = value.to(device=self.accelerator.device, dtype=torch.float64)
        else:  # filled on the device: a tensor made from a host value would be a copy the step waits for
            total = torch.full((), float(value), dtype=torch.float64, device=self.accelerator.device)
        return sum_tensor_over_ranks(self.accelerator, total)

    def most_over_ranks(self, value: int) -> int:
        """Collective: the largest of every rank's `value` (e.g. the rows each rank still has to generate for)."""
        return int(max(values_of_all_ranks(self.accelerator, value)))

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each see a distinct batch: the world size, or the world size over the TP size."""
        return tensor_parallel.data_parallel_size(self.accelerator)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among them (the ranks of a TP group share one)."""
        return tensor_parallel.data_parallel_rank(self.accelerator)

    @property
    def scratch_dir(self) -> str:
        """Where the run may write files it deletes again (a shared filesystem: every rank reads them)."""
        return str(getattr(self, "output_dir", None) or self.config.output_dir)

    def load_model_from(
        self,
        model_config,
        model_name_or_path: str | None,
        *,
        task: str = "causal-lm",
        revision: str = "main",
        **options,
    ) -> torch.nn.Module:
        """A model of `model_config` (weights from `model_name_or_path`, or initialised), with this run's attention
        implementation; under tensor parallelism sharded by transformers while it loads. A model initialised from a
        config, or a classification head the checkpoint lacks, is completed once on rank 0 (the weights one process
        would have: transformers' sharded loading leaves missing weights uninitialised) and loaded from there."""
        common = dict(
            task=task, attn_implementation=self.attn_implementation, trust_remote_code=self.config.trust_remote_code
        )

        def whole() -> torch.nn.Module:  # the model as one process loads it
            return load_model(
                model_config, model_name_or_path=model_name_or_path, revision=revision, **common, **options
            )

        layout = tensor_parallel.layout_of(self.accelerator)
        if layout is None:
            return whole()
        incomplete = model_name_or_path is None or checkpoint_lacks_task_weights(model_config, task)
        with tensor_parallel.weights_to_load(
            self.accelerator, model_name_or_path, self.scratch_dir, whole if incomplete else None
        ) as source:
            model = load_model(
                model_config,
                model_name_or_path=source,
                revision=revision if source == model_name_or_path else "main",
                distributed_config=layout.distributed_config(mixed_precision=self.accelerator.mixed_precision),
                **common,
                **options,
            )
        return tensor_parallel.sharded_root(self.accelerator, model)


@dataclasses.dataclass
class EvaluationRun(StartedRun):
    """An evaluation's start: the model source (folder, Hub id, adapter or checkpoint) and where results go."""

    source: ModelSource
    output_dir: Path
    hub_model_id: str | None


@dataclasses.dataclass
class Run(StartedRun):
    """A training run: `begin` after `accelerator.prepare` returns its `Training` (the loop's parts and `finish`)."""

    config: TrainingConfig
    checkpoint: Path | None
    config_changes: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # resumed: allowed, old -> new
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    total_steps: int = 0
    compile_note: str = ""  # whether the decoder layers are compiled, and why (train/compilation.py)
    fused_kernels: str | None = None  # use_liger_kernel: what liger patched into the model
    uploads: list = dataclasses.field(default_factory=list)  # hub_strategy every_save: background commits

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

    def fault_point(self, step: int) -> None:
        """Where FSDP_RECIPES_FAULT can kill or fail a rank after a step, to rehearse crashes; nothing otherwise."""
        inject_fault("after-step", step, self.accelerator.process_index)

    def load_model(self, **options) -> torch.nn.Module:
        """The model for this run's task: the pretrained weights of `model_name_or_path`, or initialised from the
        config of `model_config`, with the attention implementation the checks chose; `options` go to
        `modeling.load_model` (adapters.loading_options: dtype, quantisation, device)."""
        config = self.config
        model = self.load_model_from(
            self.model_config, config.model_name_or_path, task=self.task, revision=config.model_revision, **options
        )
        if config.use_liger_kernel:  # checked before loading: a CUDA device and a model type liger patches
            self.fused_kernels = fused_kernels.apply_liger_kernels(model)
        return model

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
        frozen_models: dict[str, torch.nn.Module | None] | None = None,
        save_multiple: int = 1,
    ) -> Training:
        """Collective, after `accelerator.prepare`. Restores the checkpoint (if resuming), writes the run summary,
        starts the metrics log and trackers, and sets up logging, evaluation and checkpoint cadence. Returns the
        `Training`: the batch stream at the right data position, the steps still to run and those components.

        `train_loader` is a prepared DataLoader (its position is progress.json's, valid on any world size), or a
        stream that keeps each rank's own position: it has BatchStream's `take`, `epoch` and `batches_into_epoch`
        plus `state_dict()`, which every checkpoint stores per rank; the recipe restores it (`read_rank_state`)
        before loading weights, so it is used here as it is. `checkpoint_files`: {name: text} kept in every
        checkpoint, committed with it (e.g. values computed before the first step that a resume needs).
        `frozen_models`: {name: a frozen model kept beside the policy, or None}, whose bytes on each rank the summary's
        `state_bytes_per_rank` then shows under that name (0 for None). `save_multiple`: a checkpoint a preemption
        forces falls on a step that is a multiple of it (a resume must start where the recipe can)."""
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
                        self.data_parallel_size, config.per_device_train_batch_size
                    ),
                )
            first_step = progress.step + 1
            loop.apply_settings_on_resume(scheduler, config)

        adapters.register_generate_as_forward(model)
        self.summary = describe_run(accelerator, model, self.wrap_classes)
        moe = experts.describe_experts(accelerator.unwrap_model(model).config)
        if moe is not None:
            if "router_aux_loss" in (summary or {}):  # the recipe adds it (train/router_balance.py) and says how
                del moe["router_aux_loss"]
            self.summary["mixture_of_experts"] = moe
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
            upstream_keys=compat.upstream_key_notes(config) or None,
            **adapters.parameter_counts(model),
            lora=adapters.describe(config),
            optimizer_steps=total_steps,
            global_batch_rows=self.global_batch_rows,
            activation_checkpointing=activation_checkpointing_mechanism(accelerator, config.gradient_checkpointing),
            torch_compile=self.compile_note,
            use_liger_kernel=self.fused_kernels or False,
            optim=config.optim,
            export_dtype=dtype_name(self.export_dtype),
            device_name=device_name(accelerator.device),
            memory_estimate=estimate_for_run(
                accelerator,
                self.model_config,
                dataclasses.replace(config, attn_implementation=self.attn_implementation),
            ),
        )
        log = MetricsLog(
            config.output_dir,
            enabled=accelerator.is_main_process,
            printer=logs.info,
            tracker=lambda record: accelerator.log(numeric_fields(record), step=record["step"]),
        )
        if accelerator.is_main_process:
            Path(config.output_dir).mkdir(parents=True, exist_ok=True)
            log.start(resumed_step=first_step - 1 if self.resumed else None)
            write_json(Path(config.output_dir) / "run_summary.json", self.summary)
            logs.info("run summary:\n" + format_table(list(self.summary.items())))
        self._record_state_bytes_after_first_step(model, scheduler.optimizer, frozen_models)
        accelerator.init_trackers(
            config=numeric_fields(config_to_dict(config), keep_text=True), **compat.tracker_options(config, self.name)
        )
        if self.resumed:
            changes = {"config_changes": self.config_changes} if self.config_changes else {}
            log.log(
                {
                    "step": first_step - 1,
                    "event": "resumed",
                    "checkpoint": str(self.checkpoint),
                    "world_size": accelerator.num_processes,
                    **changes,
                }
            )
            for name, (old, new) in self.config_changes.items():
                logs.warning(f"warning: resumed with {name} {old!r} -> {new!r} (allow_config_change)")

        metrics = StepLogger(
            accelerator,
            log,
            every=config.logging_steps,
            total_steps=total_steps,
            model_config=self.model_config,
            non_embedding_parameters=count_non_embedding_parameters(accelerator.unwrap_model(model)),
            peak_flops=peak_flops_per_device(self.summary["device_name"], config.peak_flops_per_device),
            position=lambda: {"epoch": batches.epoch, "lr": scheduler.get_last_lr()[0]},
        )
        evaluation = evaluator or Evaluation()
        evaluation.attach(log=log, total_steps=total_steps, pause=metrics.window.paused)
        checkpoints = checkpoints_lib.Checkpointer(
            accelerator,
            config.output_dir,
            every=config.save_steps,
            total_steps=total_steps,
            save_total_limit=config.save_total_limit,
            pause=metrics.window.paused,
            position=lambda step: checkpoints_lib.TrainingProgress(
                step=step,
                epoch=batches.epoch,
                batches_into_epoch=batches.batches_into_epoch,
                world_size=self.data_parallel_size,  # the ranks reading distinct data
                per_device_train_batch_size=config.per_device_train_batch_size,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                data_state_per_rank=per_rank_stream,
            ),
            rank_state=batches.state_dict if per_rank_stream else None,
            extra_files=checkpoint_files,
            after_save=lambda step: self.push_at_save(model, step, train_loss=log.last("loss")),
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
        # eval_strategy / save_strategy / logging_strategy (steps, epoch, no) decide each component's cadence
        per_epoch = None if per_rank_stream else -(-len(train_loader) // config.gradient_accumulation_steps)
        for component, kind in ((metrics, "logging"), (evaluation, "eval"), (checkpoints, "save")):
            component.cadence = compat.cadence(config, kind, total_steps=total_steps, steps_per_epoch=per_epoch)
        return Training(
            self,
            batches=batches,
            first_step=first_step,
            log=log,
            metrics=metrics,
            evaluation=evaluation,
            checkpoints=checkpoints,
            save_multiple=save_multiple,
        )

    def _record_state_bytes_after_first_step(self, model, optimizer, frozen_models=None) -> None:
        """After the first optimizer step (collective, as every rank steps), the run summary gets the bytes each rank
        really holds (`state_bytes_per_rank`) beside what the estimator predicted for it (`memory_estimate`)."""
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)

        def record(*_):
            hook.remove()
            held = held_state_bytes(
                model, torch_optimizer, frozen_models, split_experts=not getattr(self.config, "use_peft", False)
            )
            self.summary["state_bytes_per_rank"] = (
                gather_object([held]) if self.accelerator.num_processes > 1 else [held]
            )
            if self.accelerator.is_main_process:
                write_json(Path(self.config.output_dir) / "run_summary.json", self.summary)

        hook = torch_optimizer.register_step_post_hook(record)

    @property
    def global_batch_rows(self) -> int:
        config = self.config
        return config.per_device_train_batch_size * self.data_parallel_size * config.gradient_accumulation_steps

    @property
    def accelerate_settings(self) -> dict[str, Any]:
        return {"launch_environment": launch_environment(), "resolved": self.summary}

    @property
    def export_dtype(self) -> torch.dtype:
        """The exported weights' dtype: export_dtype, else the config's torch_dtype/dtype, else the base model's."""
        return resolve_export_dtype(
            getattr(self.config, "export_dtype", "auto"), self.model_config, recipe_dtype_override(self.config)
        )

    def push_at_save(self, model, step: int, *, train_loss: float | None) -> None:
        """Collective, after each checkpoint; with hub_strategy every_save, the model as it is now is exported to
        output_dir and uploaded in the background while training goes on (at the last step, the end's push does it)."""
        config = self.config
        if not config.push_to_hub or getattr(config, "hub_strategy", "end") != "every_save" or step >= self.total_steps:
            return
        folder = self.export(model, {"step": step, "train_loss": train_loss})
        if self.accelerator.is_main_process:
            options = dict(private=config.hub_private_repo, commit_message=f"Training in progress, step {step}")
            self.uploads.append(
                push_folder_to_hub(folder, config.hub_model_id, token=self.hub_token, run_as_future=True, **options)
            )

    def export(self, model, metrics: dict[str, Any], eval_results: list | None = None) -> Path | None:
        """Collective: the model folder (or adapter folder) in output_dir, read back and compared, with its card."""
        config, accelerator = self.config, self.accelerator
        card = dict(
            recipe=self.name,
            recipe_config=config_to_dict(config),
            accelerate_config=self.accelerate_settings,
            metrics={key: value for key, value in metrics.items() if value is not None},
            base_model=config.model_name_or_path,
            dataset=config.dataset_name,
            hub_model_id=config.hub_model_id,
            eval_results=eval_results,
            task=self.task,
        )
        if adapters.is_adapter_model(accelerator.unwrap_model(model)):
            return adapter_export.export_adapter_folder(
                accelerator,
                model,
                self.tokenizer,
                config.output_dir,
                task=self.task,
                config=config,
                card_writer=lambda where, library: write_model_card(where, library_name=library, **card),
                dtype=self.export_dtype,
            )
        return export_model_folder(
            accelerator, model, self.tokenizer, config.output_dir, task=self.task, card=card, dtype=self.export_dtype
        )
