"""Evaluation that every rank runs in lockstep (under FSDP each forward pass is a collective): held-out loss with the
recipe's own loss function, greedy-generation exact match, and metrics computed with `evaluate` over predictions
gathered from every rank. `LossEvaluator` and `MetricEvaluator` hold their cadence (`Evaluation`).

Metrics load offline: the names in `SHIPPED_METRICS` are `evaluate` modules in `fsdp_recipes/metric_scripts/` (built
on scikit-learn, rouge-score and sacrebleu), loaded by path; `evaluate.load("accuracy")` itself would fetch the Hub's
script. A name that cannot be loaded is one ConfigError before any model loads (`load_metrics`).

The functions take the run's layout (`parallel`: `run.parallel`; the evaluators get it from `run.begin`): the ranks of
a TP or SP group share one batch, so rows are split over, and values gathered from, the data-parallel ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.rows import IGNORE_INDEX, collate_rows
from fsdp_recipes.distributed.collectives import gather_for_metrics, on_every_rank_together, sum_tensor_over_ranks
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models.experts import generation_options
from fsdp_recipes.train import generation
from fsdp_recipes.train.cadence import Cadence
from fsdp_recipes.train.losses import count_targets
from fsdp_recipes.train.metrics import MetricsLog

LossSum = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
# (model, batch) -> per-example values of the batch: `predictions` and `references` (tensors or lists of strings) for
# the metrics, and any other per-example number (e.g. `loss`), reported as its mean.
Predict = Callable[[torch.nn.Module, dict[str, Any]], dict[str, Any]]

METRIC_SCRIPTS = Path(__file__).parent / "metric_scripts"
SHIPPED_METRICS = tuple(sorted(path.stem for path in METRIC_SCRIPTS.glob("*.py")))


class Evaluation:
    """Held-out figures every `every` optimizer steps (None: only at the end) and at the last step, logged at that
    step. The recipe builds the evaluator (what to measure, on which data); `run.begin` attaches the metrics log, the
    run's length and layout (`run.parallel`: the data-parallel ranks the held-out data is split over) and the pause
    that keeps evaluation time out of the throughput figures. This base measures nothing: a run without held-out
    data."""

    def __init__(self, *, every: int | None = None):
        self.every = every
        self.cadence = Cadence(every, total_steps=0)
        self.log: MetricsLog | None = None
        self.parallel: ParallelDims | None = None
        self.pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.last_step: int | None = None
        self.results: dict[str, Any] = {}

    def attach(
        self,
        *,
        log: MetricsLog,
        total_steps: int,
        parallel: ParallelDims,
        pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.log, self.pause, self.cadence = log, pause, Cadence(self.every, total_steps)
        self.parallel = parallel

    def maybe_evaluate(self, step: int) -> dict[str, Any] | None:
        """Collective when due (every rank calls it every step)."""
        return self.evaluate(step) if self.cadence.due(step) and step != self.last_step else None

    def final_results(self) -> dict[str, Any]:
        """The last step's figures: evaluated now unless that already happened."""
        self.maybe_evaluate(self.cadence.total_steps)
        return dict(self.results)

    def evaluate(self, step: int) -> dict[str, Any] | None:
        with self.pause():
            results = self.measure()
        if not results:
            return None
        self.log.log({"step": step, **results})
        self.last_step, self.results = step, results
        return results

    def measure(self) -> dict[str, Any]:
        return {}


class LossEvaluator(Evaluation):
    """Held-out loss with the recipe's own loss function, logged as `eval_loss` (nothing without rows)."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        rows,
        *,
        loss_sum: LossSum,
        batch_size: int,
        pad_token_id: int,
        every: int | None,
        pictures=None,
    ):
        super().__init__(every=every)
        self.accelerator, self.model, self.rows = accelerator, model, rows
        self.loss_sum, self.batch_size, self.pad_token_id = loss_sum, batch_size, pad_token_id
        self.pictures = pictures

    def measure(self) -> dict[str, Any]:
        if self.rows is None:
            return {}
        return {
            "eval_loss": evaluate_loss(
                self.accelerator,
                self.model,
                self.rows,
                parallel=self.parallel,
                loss_sum=self.loss_sum,
                batch_size=self.batch_size,
                pad_token_id=self.pad_token_id,
                pictures=self.pictures,
            )
        }


@torch.no_grad()
def evaluate_loss(
    accelerator: Accelerator,
    model: torch.nn.Module,
    rows,
    *,
    parallel: ParallelDims,
    loss_sum: LossSum,
    batch_size: int,
    pad_token_id: int,
    pictures=None,
) -> float:
    """Mean per-token loss over all held-out rows, each counted once, with the recipe's `loss_sum(model, batch)`.
    Every rank runs the same number of forward passes (FSDP needs all ranks in every all-gather); a rank out of rows
    runs a masked copy of a row. `pictures`: the processor that gives rows with images their pixel values."""
    model.eval()
    # the ranks of a TP or SP group run the same rows (their forward is one collective computation)
    rank, world = parallel.data_parallel_rank(accelerator.process_index), parallel.data_parallel_size
    mine = list(range(rank, len(rows), world))
    batches = math.ceil(math.ceil(len(rows) / world) / batch_size)
    total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for index in range(batches):
        chosen = mine[index * batch_size : (index + 1) * batch_size]
        batch = collate_rows([rows[i] for i in (chosen or [0])], pad_token_id, pictures)
        if not chosen:
            batch["targets"].fill_(IGNORE_INDEX)
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        total += loss_sum(model, batch).double()
        count += count_targets(batch)
    total = sum_tensor_over_ranks(accelerator, total, parallel=parallel)
    count = sum_tensor_over_ranks(accelerator, count, parallel=parallel)
    model.train()
    return float(total / count.clamp(min=1))


@torch.no_grad()
def exact_match_accuracy(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer,
    examples: list[dict[str, Any]],
    *,
    parallel: ParallelDims,
    max_new_tokens: int,
    batch_size: int,
    pictures=None,
) -> dict[str, Any]:
    """Share of held-out examples whose greedy completion equals the reference exactly (after stripping spaces).

    Examples are `{"prompt_ids": [...], "reference": str}` (and `images`, their pictures' bytes, which `pictures`, a
    vision-language model's processor, turns into pixel values). Ranks split the examples and generate in lockstep
    (`synced_gpus`), since under FSDP every forward pass is a collective."""
    model.eval()
    rank, world = parallel.data_parallel_rank(accelerator.process_index), parallel.data_parallel_size
    mine = list(range(rank, len(examples), world))
    batches = math.ceil(math.ceil(len(examples) / world) / batch_size)
    correct = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    samples = []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    with_pictures = pictures is not None and any("images" in example for example in examples)
    if with_pictures:
        generation.set_up_for_pictures(model, tokenizer.pad_token_id)
    try:
        for index in range(batches):
            chosen = mine[index * batch_size : (index + 1) * batch_size]
            batch_examples = [examples[i] for i in (chosen or [0])]
            inputs = dict(tokenizer.pad({"input_ids": [e["prompt_ids"] for e in batch_examples]}, return_tensors="pt"))
            if pictures is not None and "images" in batch_examples[0]:
                inputs.update(pictures.pixel_inputs(inputs["input_ids"], [e["images"] for e in batch_examples]))
            inputs = {key: value.to(accelerator.device) for key, value in inputs.items()}
            # transformers encodes pictures outside the model's forward, where FSDP2 gathers nothing: gathered here
            with generation.weights_gathered(model, enabled=with_pictures):  # DDP (NO_SHARD): its module generates
                output = getattr(model, "module", model).generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    synced_gpus=accelerator.num_processes > 1,
                    **generation_options(model),
                )
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            if not chosen:
                continue
            for example, text in zip(batch_examples, texts):
                hit = text.strip() == example["reference"].strip()
                correct += hit
                if len(samples) < 3:
                    samples.append({"reference": example["reference"], "generated": text.strip(), "correct": hit})
    finally:
        tokenizer.padding_side = padding_side
        model.train()
    correct = sum_tensor_over_ranks(accelerator, correct, parallel=parallel)
    return {"exact_match": float(correct) / max(len(examples), 1), "num_examples": len(examples), "samples": samples}


def prepare_for_evaluation(accelerator: Accelerator, model: torch.nn.Module, *loaders):
    """The model sharded as the Accelerate config says (FSDP2: every rank holds a shard, so a model larger than one
    device fits) and the loaders split across ranks, for evaluation only. Accelerate's FSDP2 `prepare` accepts a model
    only together with an optimizer: a plain SGD stands in, which holds no state and is never stepped. Without FSDP
    each rank keeps a whole copy, unwrapped (`generate` needs the model itself, and no gradients are reduced)."""
    from accelerate.utils import DistributedType

    model.eval()
    if accelerator.distributed_type == DistributedType.FSDP:
        model, _, *loaders = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), *loaders)
    else:
        model = model.to(accelerator.device)
        loaders = [accelerator.prepare_data_loader(loader) for loader in loaders]
    return (model, *loaders)


def load_metric(name: str):
    """An `evaluate` module, without network access where possible: a name in SHIPPED_METRICS loads the script shipped
    in fsdp_recipes/metric_scripts; a path loads that evaluate script (or a folder holding `<folder name>.py`); any
    other name goes to `evaluate.load`, which needs the Hub or a copy in evaluate's cache. Kept in memory, so ranks
    on one machine share no cache files."""
    import evaluate

    if name in SHIPPED_METRICS:
        return evaluate.load(str(METRIC_SCRIPTS / f"{name}.py"), keep_in_memory=True)
    if Path(name).exists():
        return evaluate.load(str(Path(name).resolve()), keep_in_memory=True)
    return evaluate.load(name, keep_in_memory=True)


CLASSIFICATION_METRICS = ("accuracy", "f1", "precision", "recall")
DEFAULT_METRICS = {"causal-lm": ["perplexity"], "sequence-classification": ["accuracy", "f1"]}


@dataclasses.dataclass
class Measures:
    """What the metric names ask for, loaded before any weights: `evaluate` modules, and perplexity or not."""

    metrics: dict[str, Any]
    perplexity: bool


def measures_for(task: str, names: list[str] | None) -> Measures:
    """The metrics `names` (None: the task's defaults) for a model of `task`: a name that applies to the other kind
    of model is a ConfigError; a misspelled one gets the closest name that applies."""
    names = names or DEFAULT_METRICS[task]
    for_causal_lm = {"perplexity", *SHIPPED_METRICS} - set(CLASSIFICATION_METRICS)
    wrong = [n for n in names if n in (CLASSIFICATION_METRICS if task == "causal-lm" else for_causal_lm)]
    if wrong:
        raise ConfigError(
            f"metrics {wrong} do not apply to a {task} model (classifiers: {sorted(CLASSIFICATION_METRICS)}; "
            "causal LMs: perplexity and generation metrics)"
        )
    known = sorted(CLASSIFICATION_METRICS if task == "sequence-classification" else for_causal_lm)
    return Measures(load_metrics([n for n in names if n != "perplexity"], known=known), "perplexity" in names)


def load_metrics(names: list[str], *, known: Sequence[str] = SHIPPED_METRICS) -> dict[str, Any]:
    """name -> loaded `evaluate` module, or one ConfigError naming every metric that could not be loaded, with the
    closest of the `known` names (those that apply here) where it looks like a misspelling of one."""
    loaded, problems = {}, []
    for name in names:
        try:
            loaded[name] = load_metric(name)
        except Exception as error:  # noqa: BLE001 - evaluate raises many types; each becomes one line
            close = difflib.get_close_matches(name, known, n=1)
            guess = f": did you mean {close[0]!r}?" if close and name.lower() != "bleu" else ""
            hint = "; for BLEU use sacrebleu" if name.lower() == "bleu" else ""
            problems.append(
                f"metric {name!r} cannot be loaded{guess} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:160]}). "
                f"Shipped, loaded without network: {', '.join(SHIPPED_METRICS)}{hint}; or give the path of an evaluate "
                "metric script; other Hub metrics load only once they are in evaluate's cache (load them once with "
                "network access)"
            )
    if problems:
        raise ConfigError(problems)
    return loaded


@torch.no_grad()
def gather_predictions(
    accelerator: Accelerator, model: torch.nn.Module, loader, predict: Predict, *, parallel: ParallelDims
) -> dict[str, list]:
    """Every rank runs `predict` over its share of a loader that `accelerator.prepare` split (the same number of
    batches on every rank, as FSDP needs); each batch's values are gathered with `gather_for_metrics`, which drops the
    copies that pad an uneven last batch (and a TP or SP group's copies of its batch), so every example counts exactly
    once and in dataset order. The same lists are returned on every rank."""
    was_training = model.training
    model.eval()
    gathered: dict[str, list] = {}
    try:
        for batch in loader:
            for key, value in predict(model, batch).items():
                if torch.is_tensor(value):
                    value = gather_for_metrics(accelerator, value.contiguous(), parallel=parallel).cpu().tolist()
                else:
                    value = gather_for_metrics(accelerator, list(value), parallel=parallel, use_gather_object=True)
                gathered.setdefault(key, []).extend(value)
    finally:
        model.train(was_training)
    failures = getattr(predict, "failures", None)  # a server's failure, held back until every rank is here
    if failures is not None:
        on_every_rank_together(accelerator, lambda: _raise_first(failures))
    return gathered


def _raise_first(failures: list) -> None:
    if failures:
        raise failures[0]


def compute_metrics(metrics: dict[str, Any], gathered: dict[str, list], *, prefix: str = "eval_") -> dict[str, Any]:
    """The metrics (combined with `evaluate.combine`) over the gathered predictions and references, the mean of every
    other gathered value, and the number of examples; keys prefixed as the Trainer does (`eval_accuracy`)."""
    import evaluate

    predictions, references = gathered.get("predictions", []), gathered.get("references", [])
    results = {}
    if metrics and predictions:
        results = evaluate.combine(list(metrics.values())).compute(predictions=predictions, references=references)
    results.update(
        {
            key: math.fsum(values) / len(values)
            for key, values in gathered.items()
            if key not in ("predictions", "references") and values
        }
    )
    results["samples"] = len(predictions) if predictions else max((len(v) for v in gathered.values()), default=0)
    return {f"{prefix}{key}": value for key, value in results.items()}


class MetricEvaluator(Evaluation):
    """`evaluate` metrics over a held-out loader (prepared by accelerate; None: nothing to evaluate), logged as
    `eval_<name>` with the mean of any other per-example value `predict` returns (e.g. `eval_loss`). The last
    evaluation's gathered values stay in `gathered` for figures a recipe adds at the end (e.g. per-class scores)."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        loader,
        *,
        predict: Predict,
        metrics: dict[str, Any],
        every: int | None,
    ):
        super().__init__(every=every)
        self.accelerator, self.model, self.loader, self.predict, self.metrics = (
            accelerator,
            model,
            loader,
            predict,
            metrics,
        )
        self.gathered: dict[str, list] = {}

    def measure(self) -> dict[str, Any]:
        if self.loader is None:
            return {}
        self.gathered = gather_predictions(
            self.accelerator, self.model, self.loader, self.predict, parallel=self.parallel
        )
        return compute_metrics(self.metrics, self.gathered)
