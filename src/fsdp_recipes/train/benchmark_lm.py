"""lm-evaluation-harness on the model as the run holds it (FSDP2-sharded, TP, or whole): `ShardedLM` is lm-eval's own
HF model class (`HFLM`: its tokenization, batching, truncation and scoring, so the scores are those of
`lm_eval --model hf` on the exported folder) with three things changed:

- the ranks split the documents by data-parallel rank (a TP group shares its documents), and lm-eval's gathers keep
  one copy per data-parallel rank, so a score does not depend on the split;
- every forward is a collective under FSDP2 or TP, while lm-eval batches each rank's requests on its own (grouped by
  context, so ranks may need different numbers of forwards): each forward is one lockstep round, in which every rank
  says whether it has a batch (an all-reduce) and a rank without one runs a one-token forward, until no rank has
  one. Generation rounds do the same with one-token generations;
- generation goes through the run's `generation_backend` (`train.generation.generate_completions`): transformers'
  engines in lockstep, or the vLLM server, which must hold the weights being scored.

`score` runs lm-eval's `simple_evaluate` with the plan's tasks (`train.benchmarks.plan`) and returns flat figures:
`benchmark/<task>/<metric>` (the filter after a `/` when it is not lm-eval's `none`) and `benchmark_time_s`.
`BenchmarkEvaluation` schedules it in a training run beside the recipe's own evaluator."""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections.abc import Callable
from typing import Any

import numpy
import torch

from fsdp_recipes.distributed.collectives import gather_lists, gather_tensors
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train import generation
from fsdp_recipes.train.benchmarks import BenchmarkPlan, quiet_lm_eval
from fsdp_recipes.train.evaluation import Evaluation

PREFIX = "benchmark/"


def _lm_class():
    from lm_eval.models.huggingface import HFLM

    class ShardedLM(HFLM):
        """HFLM over a model already loaded, sharded and prepared by the run (see the module's docstring)."""

        def __init__(self, model, tokenizer, *, accelerator, parallel: ParallelDims, batch_size: int, settings):
            with contextlib.redirect_stderr(io.StringIO()), quiet_lm_eval():
                super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            self.accelerator_of_run, self.parallel, self.settings = accelerator, parallel, settings
            self._rank = parallel.data_parallel_rank(accelerator.process_index)
            self._world_size = parallel.data_parallel_size
            self.lockstep = accelerator.num_processes > 1

        # --- lm-eval's collectives, over data-parallel ranks ----------------------------------------------------------
        def all_gather(self, tensor):
            if self.accelerator_of_run.num_processes == 1:
                return tensor
            return gather_tensors(self.accelerator_of_run, tensor.reshape(-1), parallel=self.parallel)

        def gather_object(self, obj, dst=0):
            if self.accelerator_of_run.num_processes == 1:
                return [obj]
            return gather_lists(self.accelerator_of_run, [obj], parallel=self.parallel)

        def barrier(self):
            self.accelerator_of_run.wait_for_everyone()

        def get_model_info(self) -> dict:  # HFLM's asks the Hub for the model's sha: a run's model has none
            return {"model_num_parameters": sum(p.numel() for p in self._model.parameters())}

        # --- lockstep rounds --------------------------------------------------------------------------------------------
        def _round(self, working: bool) -> bool:
            """Collective: whether any rank has work this round."""
            if not self.lockstep:
                return working
            flag = torch.tensor([1.0 if working else 0.0], device=self.accelerator_of_run.device)
            torch.distributed.all_reduce(flag)
            return bool(flag.item() > 0)

        def _finish_rounds(self, idle) -> None:
            while self._round(False):
                idle()

        def _idle_forward(self) -> None:
            self.model(torch.full((1, 1), self.eot_token_id, device=self.device))

        def _idle_generation(self) -> None:
            if self.settings.backend != "vllm":  # the server's generations are no collective of the ranks'
                one = [[self.eot_token_id]]
                generation.generate_completions(
                    self.model, self.tokenizer, one, [0], _settings(self.settings, 1, {}), synced_gpus=self.lockstep
                )

        def _model_call(self, inps, attn_mask=None, labels=None):
            self._round(True)
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            results = super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
            with torch.no_grad():
                self._finish_rounds(self._idle_forward)
            return results

        def generate_until(self, requests, disable_tqdm: bool = False):
            results = super().generate_until(requests, disable_tqdm=disable_tqdm)
            self._finish_rounds(self._idle_generation)
            return results

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            self._round(True)
            mask = generation_kwargs.pop("attention_mask", None)
            prompts = [
                row[row_mask.bool()].tolist() if mask is not None else row.tolist()
                for row, row_mask in zip(context, mask if mask is not None else context)
            ]
            budget = max_length - context.shape[1]
            settings = _settings(self.settings, budget, generation_kwargs)
            keys = list(range(len(prompts)))
            token_ids, _ = generation.generate_completions(
                self.model, self.tokenizer, prompts, keys, settings, synced_gpus=self.lockstep
            )
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            width = max([len(ids) for ids in token_ids] + [1])
            completions = torch.full((len(prompts), width), pad, dtype=context.dtype, device=context.device)
            for row, ids in enumerate(token_ids):
                completions[row, : len(ids)] = torch.tensor(ids, dtype=context.dtype)
            return torch.cat([context, completions], dim=1)  # HFLM cuts the context off by its width

    return ShardedLM


def sharded_lm(model, tokenizer, *, accelerator, parallel: ParallelDims, batch_size: int, settings):
    """lm-eval's model object over the run's model (`ShardedLM`, above): what `score` hands `simple_evaluate`."""
    return _lm_class()(
        model, tokenizer, accelerator=accelerator, parallel=parallel, batch_size=batch_size, settings=settings
    )


def _settings(base: generation.GenerationSettings, budget: int, kwargs: dict) -> generation.GenerationSettings:
    """The run's generation settings for one lm-eval batch: its token budget, and its task's sampling (lm-eval's
    gen_kwargs: greedy unless do_sample, or a temperature above 0, says otherwise)."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    sample = bool(kwargs.get("do_sample", temperature > 0))
    return generation.GenerationSettings(
        max_completion_length=max(budget, 1),
        temperature=temperature if sample and temperature > 0 else 1.0,
        top_p=float(kwargs.get("top_p", 1.0) or 1.0),
        top_k=kwargs.get("top_k"),
        batch_size=base.batch_size,
        seed=base.seed,
        backend=base.backend,
        compile_backend=base.compile_backend,
        compile_mode=base.compile_mode,
        greedy=not sample,
        block_eos_first=False,
        server=base.server,
    )


def flat_results(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `results` as `benchmark/<task>/<metric>` figures (stderrs left out: `stderrs` has them)."""
    flat = {}
    for task, figures in results.get("results", {}).items():
        for key, value in figures.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, kind = key.split(",", 1)
            name = metric if kind == "none" else f"{metric}/{kind}"
            flat[f"{PREFIX}{task}/{name}"] = float(value)
    return flat


def stderrs(results: dict[str, Any]) -> dict[str, float]:
    flat = {}
    for task, figures in results.get("results", {}).items():
        for key, value in figures.items():
            if "_stderr," in key and isinstance(value, (int, float)):
                metric, kind = key.split(",", 1)
                name = metric.replace("_stderr", "") if kind == "none" else f"{metric.replace('_stderr', '')}/{kind}"
                flat[f"{PREFIX}{task}/{name}"] = float(value)
    return flat


@contextlib.contextmanager
def _rng_kept():
    """lm-eval seeds Python's, NumPy's and torch's generators: a training run's own streams continue after it as if
    it had not run."""
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)


def score(
    plan: BenchmarkPlan,
    model,
    tokenizer,
    *,
    accelerator,
    parallel: ParallelDims,
    batch_size: int,
    settings: generation.GenerationSettings,
    bootstrap_iters: int = 0,
    log_samples: bool = False,
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """Collective: the plan's tasks scored on `model` (every rank calls it). Returns the flat figures (on every rank,
    with `benchmark_time_s`) and lm-eval's whole results (on the main process; None elsewhere), with every document's
    prompt, answers and scores under `samples` when `log_samples`."""
    from lm_eval import simple_evaluate

    started = time.perf_counter()
    was_training = model.training
    lm = sharded_lm(
        model, tokenizer, accelerator=accelerator, parallel=parallel, batch_size=batch_size, settings=settings
    )
    whole = plan.generates and settings.backend in ("paged", "static_compiled")  # each rank's engine runs alone
    try:
        with _rng_kept(), quiet_lm_eval(), contextlib.redirect_stderr(io.StringIO()):
            with generation.weights_gathered(
                model, enabled=whole, reshard_after_forward=generation.reshard_after_forward(accelerator)
            ):
                results = simple_evaluate(
                    model=lm,
                    tasks=list(plan.specs),
                    task_manager=plan.task_manager,
                    num_fewshot=plan.num_fewshot,
                    limit=plan.limit,
                    apply_chat_template=plan.apply_chat_template,
                    gen_kwargs=plan.gen_kwargs,
                    bootstrap_iters=bootstrap_iters,
                    log_samples=log_samples,
                )
    finally:
        model.train(was_training)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        results = broadcast_object_list([results if accelerator.is_main_process else None])[0]
    figures = flat_results(results)
    figures["benchmark_time_s"] = time.perf_counter() - started
    return figures, results if accelerator.is_main_process else None


class BenchmarkEvaluation(Evaluation):
    """A training run's evaluation with lm-eval benchmarks beside it: the recipe's own evaluator (`inner`) keeps its
    cadence (eval_steps); `score` (the run's `score_benchmarks` on its model) runs every `benchmark_steps` and at the
    end, logged in the same metrics log (and so kept by a resumed run, which reads the log's earlier records)."""

    def __init__(self, inner: Evaluation, score: Callable[[], dict[str, float]], *, every: int | None):
        super().__init__(every=every)
        self.inner, self.score = inner, score

    def maybe_evaluate(self, step: int) -> dict[str, Any] | None:
        inner = self.inner.maybe_evaluate(step)
        benchmarks = super().maybe_evaluate(step)
        return ({**(inner or {}), **(benchmarks or {})}) or None

    def final_results(self) -> dict[str, Any]:
        self.maybe_evaluate(self.cadence.total_steps)
        return {**self.inner.results, **self.results}

    def measure(self) -> dict[str, Any]:
        return self.score()
