"""`TrainingLoop`: what the loop reads, handed over by `Run.begin`, every part built and none of them None. `Run` is
the run around the loop (its set-up: `start`, `load_model`, `begin`; its end: the export and the Hub); the loop itself
reads only this: the batch stream at the resumed data position, the steps still to run (with the progress bar), the
one optimizer step every recipe calls (with the fault point that rehearses crashes), and the components that keep
their own cadence: `metrics` (logging), `evaluation` (the recipe's evaluator), `checkpoints` (saves), over the run's
`log`. `finish` ends the run."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from fsdp_recipes.common.errors import NonFiniteError, Preempted
from fsdp_recipes.common.faults import inject_fault
from fsdp_recipes.common.tables import format_table
from fsdp_recipes.common.yaml_json import write_json
from fsdp_recipes.distributed import logs
from fsdp_recipes.publish.evaluation_results import benchmark_card_results
from fsdp_recipes.publish.hub import push_folder_to_hub
from fsdp_recipes.train import expert_bias, preemption
from fsdp_recipes.train.benchmark_lm import PREFIX
from fsdp_recipes.train.checkpoint import Checkpointer, latest_checkpoint
from fsdp_recipes.train.evaluation import Evaluation
from fsdp_recipes.train.loop import BatchStream
from fsdp_recipes.train.metrics import MetricsLog, StepLogger, memory_figure_notes, plot_training_curves


@dataclasses.dataclass
class TrainingLoop:
    run: Any  # the `Run` whose begin built this (runs.py imports this module, not the other way round)
    batches: BatchStream
    first_step: int
    log: MetricsLog
    metrics: StepLogger
    evaluation: Evaluation
    checkpoints: Checkpointer
    save_multiple: int = 1  # a preemption saves at a step that is a multiple of it (GRPO: between rounds)
    bar: tqdm | None = dataclasses.field(default=None, init=False)
    skipped_steps: int = dataclasses.field(default=0, init=False)  # non-finite steps skipped since this launch

    @property
    def total_steps(self) -> int:
        return self.run.total_steps

    def steps(self) -> Iterator[int]:
        """The optimizer steps still to run, first_step..total_steps, behind a progress bar (main process only) that
        `optimizer_step` advances. After each step (the recipe's body done, its saves included) every rank asks
        whether any rank got a preemption signal; if one did, all save the step's checkpoint and stop (`Preempted`)
        at the first step that is a multiple of `save_multiple`."""
        accelerator, config = self.run.accelerator, self.run.config
        self.bar = tqdm(
            total=self.total_steps,
            initial=self.first_step - 1,
            disable=not accelerator.is_main_process,
            desc=self.run.name,
        )
        watch = preemption.PreemptionWatch(config.preemption_signals)
        started = time.perf_counter()
        try:
            for step in range(self.first_step, self.total_steps + 1):
                yield step
                if step == self.first_step:  # the start-up a launch pays once: compile, allocator, first batch
                    self.log.log({"step": step, "first_step_time_s": time.perf_counter() - started})
                if step % self.save_multiple == 0 and watch.requested(accelerator):
                    self._stop_for_preemption(step, watch.received)
        finally:
            watch.close()
            self.bar.close()

    def _stop_for_preemption(self, step: int, received: str | None) -> None:
        saved = self.checkpoints.save(step)
        if self.run.accelerator.is_main_process:
            preemption.mark_preempted(self.run.config.output_dir, saved)
        self.run.accelerator.wait_for_everyone()
        raise Preempted(
            f"{received or 'a signal on another rank'}: every rank finished step {step} and saved {saved}. Start the "
            "same command again: it resumes from there by itself"
        )

    def optimizer_step(self, step: int, model, optimizer, scheduler) -> torch.Tensor:
        """What ends optimizer step `step` in every recipe: the gradient norm taken over all ranks and the gradients
        clipped to `max_grad_norm` (0: measured, not clipped); a norm that is not finite stops the run on every rank
        before the update (or skips the update, `skip_nonfinite_steps`); the optimizer stepped, and with it a
        DeepSeek-style router's bias (`train.expert_bias`, collective); the schedule stepped, the
        gradients freed, the progress bar advanced, and FSDP_RECIPES_FAULT's points. Returns the norm before
        clipping."""
        config, accelerator = self.run.config, self.run.accelerator
        if inject_fault("before-step", step, accelerator.process_index):
            _poison_gradients(model)
        # clipping to inf multiplies by 1.0: the norm is measured and the gradients are bitwise as they were
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf)
        bias = expert_bias.attached(model)  # DeepSeek-style routers: the bias follows the step's global loads
        if torch.isfinite(grad_norm):  # a host sync, on a value global to every rank
            optimizer.step()
            if bias is not None:
                bias.update(accelerator, self.run.parallel)
        else:
            if bias is not None:
                bias.discard()
            self._nonfinite_step(step, grad_norm)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if self.bar is not None:
            self.bar.update(1)
        inject_fault("after-step", step, self.run.accelerator.process_index)  # FSDP_RECIPES_FAULT: rehearsed crashes
        return grad_norm

    def _nonfinite_step(self, step: int, grad_norm: torch.Tensor) -> None:
        config = self.run.config
        self.skipped_steps += 1
        if self.skipped_steps > config.skip_nonfinite_steps:
            latest = latest_checkpoint(config.output_dir)
            raise NonFiniteError(
                f"step {step}: the gradient norm is {float(grad_norm)}: a loss or gradient is not a finite number. "
                "The step's update was not applied; the weights were not exported, and output_dir and the last "
                f"checkpoint ({latest.name if latest else 'none yet'}) are as they were. Likely causes: a learning "
                "rate too high for this model and batch (lower learning_rate, or warm up with warmup_steps), a "
                "value that is not finite in the data or from a reward function, a loss that overflows in "
                "float16 (use bf16). To skip such steps instead, set skip_nonfinite_steps: N"
            )
        logs.warning(
            f"warning: step {step}: the gradient norm is {float(grad_norm)}; the update is skipped "
            f"({self.skipped_steps} of skip_nonfinite_steps {config.skip_nonfinite_steps})"
        )
        self.log.log({"step": step, "event": "skipped_nonfinite_step", "skipped_nonfinite_steps": self.skipped_steps})

    def measured_once(self, key: str, measure: Callable[[], float]) -> float:
        """A figure taken before training (e.g. accuracy of the untrained model): measured and logged at step 0 by a
        new run; a resumed run reads it from the main process's log (or, resumed into another folder, from the log of
        the run that wrote the checkpoint) instead of measuring a half-trained model: NaN when neither has it."""
        if self.run.resumed:
            first = self.log.first(key)
            if first is None and self.run.checkpoint is not None:  # resumed into another folder: the run's own log
                first = _first_logged(self.run.checkpoint.parent.parent / "metrics.jsonl", key)
                if first is not None:
                    self.log.log({"step": 0, key: first})
            first = math.nan if first is None else first  # neither log kept it (the checkpoint's moved without one)
            return broadcast_object_list([first])[0] if self.run.accelerator.num_processes > 1 else first
        value = measure()
        self.log.log({"step": 0, key: value})
        return value

    def finish(
        self,
        model,
        *,
        results: dict[str, Any] | None = None,
        eval_results: list | None = None,
        summary: dict[str, Any] | None = None,
    ) -> Path | None:
        """Collective. Evaluates at the last step if that has not happened, prints the final metrics, draws the
        curves, exports the model folder (read back and compared), writes the card (with `eval_results`, a list of
        huggingface_hub EvalResults, as its model-index) and `eval_results.json`, pushes to the Hub. `summary`: run
        summary fields known only at the end, added to run_summary.json. Returns the folder on the main process."""
        run = self.run
        config, accelerator = run.config, run.accelerator
        if summary:
            run.summary.update(summary)
            if accelerator.is_main_process:
                write_json(Path(config.output_dir) / "run_summary.json", run.summary)
        self.evaluation.maybe_evaluate(self.total_steps)
        if run.benchmarks is not None:  # the last lm-eval scores: in eval_results.json and the card's model-index
            scores = {key: value for key, value in self.evaluation.results.items() if key.startswith(PREFIX)}
            results = {**(results or {}), **scores}
            eval_results = [*(eval_results or []), *benchmark_card_results(scores, run.benchmarks)]
        results = {key: value for key, value in (results or {}).items() if value is not None}
        final_metrics = {
            "train_loss": self.log.last("loss"),
            "eval_loss": self.log.last("eval_loss"),
            **results,
            **self.metrics.final_metrics(),
            "estimated_memory_gib_per_gpu": run.summary["memory_estimate"]["predicted_per_gpu_bytes"]["total"] / 2**30,
        }
        if accelerator.is_main_process:
            logs.info(
                "final metrics (speeds: means over logged windows after the first):\n"
                + format_table(list(final_metrics.items()))
                + "\n"
                + memory_figure_notes(accelerator.device.type)
            )
            plot_training_curves(self.log.records, Path(config.output_dir) / "training_curves.png")
        folder = run.export(model, final_metrics, eval_results)
        if accelerator.is_main_process:
            preemption.clear_mark(config.output_dir)  # finished: a later start is a new run
            if results:
                write_json(folder / "eval_results.json", results)
            if config.push_to_hub:
                for upload in run.uploads:  # every_save's background commits land first, in order
                    upload.result()
                url = push_folder_to_hub(
                    folder, config.hub_model_id, token=run.hub_token, private=config.hub_private_repo
                )
                logs.info(f"pushed to the Hub: {url}")
            logs.info(f"model exported to {folder.resolve()}")
        accelerator.end_training()
        return folder


def _poison_gradients(model) -> None:
    """FSDP_RECIPES_FAULT=nan-before-step:N: one gradient made NaN, as a numeric blow-up would."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.fill_(math.nan)
            return


def _first_logged(path: Path, key: str) -> Any:
    """The first value of `key` in a metrics.jsonl (None when the file or the key is missing)."""
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if key in record:
            return record[key]
    return None
