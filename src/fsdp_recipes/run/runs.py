"""The objects a recipe drives: `StartedRun` (what `start` checked and built), `EvaluationRun` (an evaluation's
start) and `Run` (a training run whose `begin`, after `accelerator.prepare`, returns the loop's `TrainingLoop`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator

from fsdp_recipes.distributed import tensor_parallel
from fsdp_recipes.distributed.accelerator import launch_environment
from fsdp_recipes.distributed.collectives import on_every_rank_together, sum_tensor_over_ranks, values_of_all_ranks
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models import adapter_export, adapters, fused_kernels, vision
from fsdp_recipes.models.export_dtype import recipe_dtype_override, resolve_export_dtype
from fsdp_recipes.models.modeling import checkpoint_lacks_task_weights, load_model
from fsdp_recipes.publish.export import export_model_folder, write_model_card
from fsdp_recipes.publish.hub import push_folder_to_hub
from fsdp_recipes.publish.model_source import ModelSource
from fsdp_recipes.run import components
from fsdp_recipes.run.training_loop import TrainingLoop
from fsdp_recipes.train import benchmark_lm, expert_bias, generation, trainer_arguments
from fsdp_recipes.train.benchmarks import BenchmarkPlan
from fsdp_recipes.train.config import RunConfig, TrainingConfig, config_to_dict
from fsdp_recipes.train.evaluation import Evaluation, LossEvaluator, LossSum

T = TypeVar("T")


@dataclasses.dataclass
class StartedRun:
    """What every recipe has once `start` (or `start_evaluation`) has run its checks: the accelerator, the tokenizer
    and model config, and what the Accelerate config will do with the model."""

    config: RunConfig
    name: str
    task: str
    accelerator: Accelerator
    parallel: ParallelDims  # the launch's layout, built once at start-up: every size is read from here
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

    def benchmark_generation(self) -> generation.GenerationSettings:
        """How lm-eval's generation tasks generate (`train.benchmark_lm`): through the run's generation_backend (and
        its vLLM server), per_device_eval_batch_size prompts at a time; each task sets its own budget and sampling."""
        config = self.config
        return generation.GenerationSettings(
            max_completion_length=1,
            batch_size=config.per_device_eval_batch_size,
            seed=getattr(config, "seed", 42),
            **generation.backend_options(config) if hasattr(config, "generation_backend") else {},
            server=getattr(self, "generation_server", None),
        )

    def score_benchmarks(self, model, *, bootstrap_iters: int = 0, log_samples: bool = False):
        """Collective: the config's lm-eval tasks (`self.benchmarks`) scored on `model` as the run holds it: (flat
        figures on every rank, lm-eval's whole results on the main process)."""
        return benchmark_lm.score(
            self.benchmarks, model, self.tokenizer, accelerator=self.accelerator, parallel=self.parallel,
            batch_size=self.config.per_device_eval_batch_size, settings=self.benchmark_generation(),
            bootstrap_iters=bootstrap_iters, log_samples=log_samples,
        )  # fmt: skip

    def sum_over_ranks(self, value: torch.Tensor | float) -> torch.Tensor:
        """Collective: the sum of `value` (a tensor or a number) over the data-parallel ranks, e.g. the target tokens
        of a global batch: a float64 tensor on the device, never read here, so the step does not wait for it."""
        if isinstance(value, torch.Tensor):
            total = value.to(device=self.accelerator.device, dtype=torch.float64)
        else:  # filled on the device: a tensor made from a host value would be a copy the step waits for
            total = torch.full((), float(value), dtype=torch.float64, device=self.accelerator.device)
        return sum_tensor_over_ranks(self.accelerator, total, parallel=self.parallel)

    def most_over_ranks(self, value: int) -> int:
        """Collective: the largest of every rank's `value` (e.g. the rows each rank still has to generate for)."""
        return int(max(values_of_all_ranks(self.accelerator, value)))

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the `parallel.data_parallel_size` ranks that each see a distinct batch (the ranks
        of a TP or SP group share one)."""
        return self.parallel.data_parallel_rank(self.accelerator.process_index)

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

        if not self.parallel.sharded_layers:
            return whole()
        incomplete = model_name_or_path is None or checkpoint_lacks_task_weights(model_config, task)
        with tensor_parallel.weights_to_load(
            self.accelerator, model_name_or_path, self.scratch_dir, whole if incomplete else None
        ) as source:
            model = load_model(
                model_config,
                model_name_or_path=source,
                revision=revision if source == model_name_or_path else "main",
                distributed_config=tensor_parallel.distributed_config(
                    self.parallel, mixed_precision=self.accelerator.mixed_precision
                ),
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
    generation_server: Any = None  # generation_backend vllm: the server (train.vllm_client.VLLMServer), checked
    checks_before_loading: list[str] = dataclasses.field(default_factory=list)  # the named checks that ran (run.checks)
    benchmarks: BenchmarkPlan | None = None  # benchmark_tasks, resolved and their data loaded before loading
    pictures: Any = None  # a vision-language model's processor (data.images.ImageInputs); None for a text model


@dataclasses.dataclass
class Run(StartedRun):
    """A training run, around its loop: the set-up (`load_model`, `loss_evaluator`, then `begin` after
    `accelerator.prepare`, which returns the `TrainingLoop` the loop reads) and the end (`export`, the Hub pushes)."""

    config: TrainingConfig
    checkpoint: Path | None
    config_changes: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # resumed: allowed, old -> new
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks_before_loading: list[str] = dataclasses.field(default_factory=list)  # the named checks that ran (run.checks)
    total_steps: int = 0
    compile_note: str = ""  # whether the decoder layers are compiled, and why (train/compilation.py)
    fused_kernels: str | None = None  # use_liger_kernel: what liger patched into the model
    uploads: list = dataclasses.field(default_factory=list)  # hub_strategy every_save: background commits
    generation_server: Any = None  # generation_backend vllm: the server (train.vllm_client.VLLMServer), checked
    benchmarks: BenchmarkPlan | None = None  # benchmark_tasks, resolved and their data loaded before loading
    pictures: Any = None  # a vision-language model's processor (data.images.ImageInputs); None for a text model

    def benchmark_generation(self) -> generation.GenerationSettings:
        """A training run's vLLM server holds the weights of its last push, not necessarily the step's: its lm-eval
        generation tasks run transformers' `generate` on the training model instead."""
        settings = super().benchmark_generation()
        if settings.backend != "vllm":
            return settings
        return dataclasses.replace(settings, backend="generate", server=None)

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

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
        if config.freeze_vision_tower or config.freeze_multi_modal_projector:  # checked: the model has them
            vision.freeze(model, tower=config.freeze_vision_tower, projector=config.freeze_multi_modal_projector)
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
            pictures=self.pictures,
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
    ) -> TrainingLoop:
        """Collective, after `accelerator.prepare`. Restores the checkpoint (if resuming), writes the run summary,
        starts the metrics log and trackers, and sets up logging, evaluation and checkpoint cadence. Returns the
        `TrainingLoop`: the batch stream at the right data position, the steps still to run and those components.

        `train_loader` is a prepared DataLoader (its position is progress.json's, valid on any world size), or a
        stream that keeps each rank's own position: it has BatchStream's `take`, `epoch` and `batches_into_epoch`
        plus `state_dict()`, which every checkpoint stores per rank; the recipe restores it (`read_rank_state`)
        before loading weights, so it is used here as it is. `checkpoint_files`: {name: text} kept in every
        checkpoint, committed with it (e.g. values computed before the first step that a resume needs).
        `frozen_models`: {name: a frozen model kept beside the policy, or None}, whose bytes on each rank the summary's
        `state_bytes_per_rank` then shows under that name (0 for None). `save_multiple`: a checkpoint a preemption
        forces falls on a step that is a multiple of it (a resume must start where the recipe can)."""
        self.total_steps = total_steps
        self.accelerator.register_for_checkpointing(scheduler)
        batches, first_step = components.resume_position(self, train_loader, scheduler)  # restores a checkpoint's state
        expert_bias.attach(model, self.config)  # DeepSeek-style routers: their bias updated after each step
        adapters.register_generate_as_forward(model)
        self.summary = components.run_summary(self, model, train_loader, summary)
        log = components.start_metrics_log(self, first_step)  # writes the summary, starts the trackers, notes a resume
        components.record_state_bytes_after_first_step(self, model, scheduler.optimizer, frozen_models)
        metrics = components.step_logger(self, model, log, batches, scheduler)
        evaluation = evaluator or Evaluation()
        evaluation.attach(log=log, total_steps=total_steps, parallel=self.parallel, pause=metrics.window.paused)
        shared = components.shared(train_loader)
        checkpoints = components.checkpointer(
            self, model, log, batches, per_rank_stream=not shared, pause=metrics.window.paused, files=checkpoint_files
        )
        # eval_strategy / save_strategy / logging_strategy (steps, epoch, no) decide each component's cadence
        per_epoch = -(-len(train_loader) // self.config.gradient_accumulation_steps) if shared else None
        for component, kind in ((metrics, "logging"), (evaluation, "eval"), (checkpoints, "save")):
            component.cadence = trainer_arguments.cadence(
                self.config, kind, total_steps=total_steps, steps_per_epoch=per_epoch
            )
        if self.benchmarks is not None:  # lm-eval tasks every benchmark_steps, beside the recipe's own evaluation
            evaluation = benchmark_lm.BenchmarkEvaluation(
                evaluation, lambda: self.score_benchmarks(model)[0], every=self.config.benchmark_steps
            )
            evaluation.attach(log=log, total_steps=total_steps, parallel=self.parallel, pause=metrics.window.paused)
        return TrainingLoop(
            self,
            batches=batches,
            first_step=first_step,
            log=log,
            metrics=metrics,
            evaluation=evaluation,
            checkpoints=checkpoints,
            save_multiple=save_multiple,
        )

    @property
    def global_batch_rows(self) -> int:
        config = self.config
        return (
            config.per_device_train_batch_size * self.parallel.data_parallel_size * config.gradient_accumulation_steps
        )

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
        # a vision-language model's folder gets its processor (image processor, tokenizer, chat template)
        files = self.pictures.processor if self.pictures is not None else self.tokenizer
        if adapters.is_adapter_model(accelerator.unwrap_model(model)):
            return adapter_export.export_adapter_folder(
                accelerator,
                model,
                files,
                config.output_dir,
                task=self.task,
                config=config,
                card_writer=lambda where, library: write_model_card(where, library_name=library, **card),
                dtype=self.export_dtype,
            )
        return export_model_folder(
            accelerator, model, files, config.output_dir, task=self.task, card=card, dtype=self.export_dtype
        )
