"""What an evaluation leaves behind (recipes/eval.py): the results in the run's trackers, `eval_results.json`, every
example's prediction beside its reference (`eval_predictions.jsonl`, in dataset order), and the results merged into
the model card's model-index, which the Hub shows on the model page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fsdp_recipes.common import yaml_json
from fsdp_recipes.publish import model_index
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import metrics as metrics_lib
from fsdp_recipes.train import trainer_arguments


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


def write(
    folder: Path,
    results: dict[str, Any],
    *,
    model: str,
    dataset: str,
    dataset_config: str | None,
    split: str,
    pipeline_tag: str,
    card_model_name: str,
    base_model: str | None,
    predictions: tuple[Sequence, Sequence] | None = None,
    label_name: Callable[[Any], Any] = str,
) -> list[model_index.EvalResult]:
    """Main process only. `eval_results.json` (the results, with the model, dataset and split they are of),
    `eval_predictions.jsonl` when there are (predictions, references), each through `label_name`, and the results
    merged into `folder`'s card (made if missing). Returns the card's results, which a Hub push merges into the repo's
    own card."""
    folder.mkdir(parents=True, exist_ok=True)
    described = dict(model=model, dataset=dataset, dataset_config=dataset_config, split=split, **results)
    yaml_json.write_json(folder / "eval_results.json", described)
    if predictions is not None:
        rows = [dict(prediction=label_name(p), reference=label_name(r)) for p, r in zip(*predictions)]
        yaml_json.write_jsonl(folder / "eval_predictions.jsonl", rows)
    card_results = model_index.eval_results(
        results, task=pipeline_tag, dataset=dataset, dataset_config=dataset_config, split=split
    )
    model_index.update_card(
        folder, card_results, model_name=card_model_name, pipeline_tag=pipeline_tag, base_model=base_model
    )
    return card_results
