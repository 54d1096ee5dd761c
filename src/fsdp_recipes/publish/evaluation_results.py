"""What an evaluation leaves behind (recipes/eval.py): the results in the run's trackers, `eval_results.json`, every
example's prediction beside its reference (`eval_predictions.jsonl`, in dataset order), and the results merged into
the model card's model-index, which the Hub shows on the model page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fsdp_recipes.common import yaml_json
from fsdp_recipes.common.tables import format_table
from fsdp_recipes.publish import hub, model_index
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import metrics as metrics_lib
from fsdp_recipes.train import trainer_arguments
from fsdp_recipes.train.benchmark_lm import PREFIX
from fsdp_recipes.train.benchmarks import BenchmarkPlan, installed_version


def log_to_trackers(accelerator, config: config_lib.RunConfig, results: dict[str, Any], *, run_name: str) -> None:
    """Collective. The config and the results (at step 0) in each tracker the config reports to; nothing without one."""
    if not config.trackers():
        return
    accelerator.init_trackers(
        config=metrics_lib.numeric_fields(config_lib.config_to_dict(config), keep_text=True),
        **trainer_arguments.tracker_options(config, run_name),
    )
    accelerator.log(metrics_lib.numeric_fields(results), step=0)
    accelerator.end_training()


def report(
    run,
    config,
    results: dict[str, Any],
    *,
    split: str | None,
    pipeline_tag: str,
    predictions: tuple[Sequence, Sequence] | None,
    label_name: Callable[[Any], Any],
    benchmarks: tuple[BenchmarkPlan | None, dict[str, Any] | None],
) -> None:
    """Collective: an evaluation's results (`run`: recipes/eval.py's EvaluationRun) in the trackers; on the main
    process `write`'s files and card, the table printed, and the Hub card's metadata updated with `push_to_hub`."""
    log_to_trackers(run.accelerator, config, results, run_name=run.name)
    if not run.accelerator.is_main_process:
        return
    source, folder = run.source, run.output_dir
    card_results = write(
        folder, results, model=source.name, dataset=config.dataset_name, dataset_config=config.dataset_config,
        split=split, pipeline_tag=pipeline_tag, card_model_name=run.hub_model_id or Path(source.name).name,
        base_model=source.name if source.kind == "hub" else None, predictions=predictions, label_name=label_name,
        benchmarks=benchmarks,
    )  # fmt: skip
    print("results:\n" + format_table(list(results.items())))
    if config.push_to_hub:  # the repo's own card keeps its text: only its metadata changes
        url = hub.add_results_to_hub_card(
            run.hub_model_id, card_results, token=run.hub_token, create_pr=config.hub_create_pr
        )
        print(f"pushed to the Hub: {url}")
    print(f"results written to {folder.resolve()}: eval_results.json, README.md (model-index)")


def write(
    folder: Path,
    results: dict[str, Any],
    *,
    model: str,
    dataset: str | None,
    dataset_config: str | None,
    split: str | None,
    pipeline_tag: str,
    card_model_name: str,
    base_model: str | None,
    predictions: tuple[Sequence, Sequence] | None = None,
    label_name: Callable[[Any], Any] = str,
    benchmarks: tuple[BenchmarkPlan | None, dict[str, Any] | None] = (None, None),
) -> list[model_index.EvalResult]:
    """Main process only. `eval_results.json` (the results, with the model, dataset and split they are of),
    `eval_predictions.jsonl` when there are (predictions, references), each through `label_name`, lm-eval's own
    results (`benchmarks`: the plan and simple_evaluate's output) in `lm_eval_results.json` and every document's
    prompt, answers and scores in `lm_eval_samples.jsonl` (lm-eval's --log_samples), and the results merged
    into `folder`'s card (made if missing). Returns the card's results, which a Hub push merges into the repo's own
    card."""
    folder.mkdir(parents=True, exist_ok=True)
    described = dict(model=model, dataset=dataset, dataset_config=dataset_config, split=split, **results)
    yaml_json.write_json(folder / "eval_results.json", described)
    if predictions is not None:
        rows = [dict(prediction=label_name(p), reference=label_name(r)) for p, r in zip(*predictions)]
        yaml_json.write_jsonl(folder / "eval_predictions.jsonl", rows)
    plan, lm_eval_output = benchmarks
    if lm_eval_output is not None:
        samples = lm_eval_output.get("samples") or {}
        lm_eval_output = {key: value for key, value in lm_eval_output.items() if key != "samples"}
        yaml_json.write_json(folder / "lm_eval_results.json", json_safe(lm_eval_output))
        rows = [{"task": task, **sample} for task, task_samples in samples.items() for sample in task_samples]
        yaml_json.write_jsonl(folder / "lm_eval_samples.jsonl", json_safe(rows))
    own = {key: value for key, value in results.items() if not key.startswith(("benchmark/", "benchmark_"))}
    card_results = (
        model_index.eval_results(own, task=pipeline_tag, dataset=dataset, dataset_config=dataset_config, split=split)
        if dataset
        else []
    ) + benchmark_card_results(results, plan)
    model_index.update_card(
        folder, card_results, model_name=card_model_name, pipeline_tag=pipeline_tag, base_model=base_model
    )
    return card_results


def json_safe(value: Any) -> Any:
    """lm-eval's results hold a few values JSON does not (numpy numbers, dtypes, functions in task configs): written
    as lm-eval's own CLI writes them (its `handle_non_serializable`)."""
    import json

    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(value, default=handle_non_serializable))


def benchmark_card_results(figures: dict[str, Any], plan: BenchmarkPlan | None) -> list[model_index.EvalResult]:
    """lm-eval scores (`benchmark/<task>/<metric>`, train.benchmark_lm) as model-index results: one per task and
    metric, under the task's name with its dataset and split, as the Hub's leaderboards list them."""
    if plan is None:
        return []
    found = []
    for info in plan.tasks:
        prefix = f"{PREFIX}{info.name}/"
        scores = {key.removeprefix(prefix): value for key, value in figures.items() if key.startswith(prefix)}
        for result in model_index.eval_results(scores, task="text-generation", dataset=info.dataset, split=info.split):
            result.dataset_name = info.name  # the benchmark, as lm-eval names it
            result.source_name = f"lm-evaluation-harness {installed_version()}"
            result.source_url = "https://github.com/EleutherAI/lm-evaluation-harness"
            found.append(result)
    return found
