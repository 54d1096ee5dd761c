"""Evaluation of a model folder, a Hub id or a recipe checkpoint, sharded with the same Accelerate configs as training,

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/eval.py \\
        --config recipes/configs/eval/<config>.yaml [--field value ...]

A model folder, Hub id, recipe checkpoint or LoRA adapter, sharded with the same Accelerate configs: perplexity,
generation metrics (exact match, ROUGE, sacrebleu, chrF) or classification metrics, the same on 1 and N ranks;
results in eval_results.json, the trackers and the card. docs/classification-and-evaluation.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, checks, errors
from fsdp_recipes.data import files, held_out
from fsdp_recipes.methods.classify import classification, classifier
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.models.positions import check_example_fits_positions
from fsdp_recipes.publish import evaluation_results, model_source
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import evaluation, generation, generation_metrics, losses, vllm_settings, weight_sync


@dataclasses.dataclass
class EvalConfig(vllm_settings.VLLMFields, config_lib.RunConfig):
    """What to evaluate, on what, and where the results go. The model, data, tracker and Hub settings every recipe has
    come from RunConfig; the fields below are eval's own, or the shared ones with eval's meaning."""

    # --- the model ----------------------------------------------------------------------------------------------------
    model_name_or_path: str | None = arguments.setting(
        None,
        "model folder, Hub id, or recipe checkpoint (output_dir/checkpoints/step-N)",
        check=checks.required("a model folder, a Hub id or a recipe checkpoint"),
    )
    base_model_name_or_path: str | None = arguments.setting(
        None,
        "LoRA adapters (a folder or a LoRA run's checkpoint): the base model to merge them into (null: "
        "the one the adapter records, refused before loading if it is a path that does not exist here)",
    )
    task: str | None = arguments.setting(
        None,
        "null: from the model (a *ForSequenceClassification is a classifier); or causal-lm, sequence-classification",
        check=checks.one_of(evaluation.DEFAULT_METRICS, or_null=True, note=" (null: from the model)"),
    )
    # --- the data -----------------------------------------------------------------------------------------------------
    dataset_split: str = arguments.setting(
        "test", "the dataset split to evaluate on (a dataset with one split: that one)"
    )
    max_eval_samples: int | None = arguments.setting(
        None, "the first N examples (null: all): faster, less precise", check=checks.at_least(1, or_null=True)
    )
    text_column: str = arguments.setting("text", "plain text for perplexity; the text a classifier reads")
    text_pair_column: str | None = arguments.setting(
        None, "classifiers: the second text, if the model was trained with one (null: none)"
    )
    label_column: str = arguments.setting("label", "classifiers: label names (as in the model's id2label) or ids")
    # --- what is measured ---------------------------------------------------------------------------------------------
    metrics: list[str] | None = arguments.setting(
        None,
        "null: perplexity for a causal LM, accuracy and f1 for a classifier (which also takes precision, "
        "recall). A causal LM also takes generation metrics: exact_match, rouge, sacrebleu, chrf or an "
        "evaluate script (each costs a full generation pass, shared between them)",
    )
    max_new_tokens: int = arguments.setting(64, "generation budget per prompt", check=checks.at_least(1))
    do_sample: bool = arguments.setting(
        False, "false: greedy decoding; true: sampling (seeded per batch, so reproducible)"
    )
    temperature: float = arguments.setting(1.0, "sampling only: softmax temperature")
    top_p: float = arguments.setting(1.0, "sampling only: nucleus size")
    seed: int = arguments.setting(42, "seeds Python, NumPy and torch, and the sampling of each batch (do_sample)")
    generation_backend: str = generation.backend_setting()
    # --- results ------------------------------------------------------------------------------------------------------
    output_dir: str | None = arguments.setting(
        None,
        "where eval_results.json, eval_predictions.jsonl and the card (README.md) go; null: the model folder itself",
    )
    push_to_hub: bool = arguments.setting(False, "merge the results into the Hub repo's card metadata (needs a token)")
    hub_model_id: str | None = arguments.setting(
        None, "the repo to update; null: model_name_or_path when that is a Hub id"
    )
    hub_create_pr: bool = arguments.setting(False, "push the results as a pull request (a repo you do not own)")
    benchmark_bootstrap_iters: int = arguments.setting(
        100000,
        "lm-eval's bootstrap_iters: resamples for the standard error of benchmark metrics that are not means (lm-eval's "
        "default; 0: no such standard errors, faster)",
        check=checks.at_least(0),
    )
    report_to: str = arguments.setting(
        "none", "tracker that also gets the results: none, tensorboard, wandb or trackio (written to output_dir)"
    )

    def scores_without_data(self) -> bool:  # lm-eval's tasks bring their own data
        return bool(self.benchmark_tasks)

    def longest_request(self) -> int:  # the prompts' lengths are known once loaded: vLLM refuses a longer one itself
        return self.max_new_tokens + 1

    def cross_field_problems(self) -> list[str]:
        problems = []
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            problems.append(f"temperature must be > 0 and top_p in (0, 1], got {self.temperature} and {self.top_p}")
        if self.metrics is not None and (not self.metrics or len(set(self.metrics)) != len(self.metrics)):
            problems.append(f"metrics must name each metric once, got {self.metrics}")
        return problems


def prepare_measures(run: run_lib.EvaluationRun, config: EvalConfig) -> evaluation.Measures | None:
    if not (config.dataset_name or config.dataset_mixture):  # benchmark_tasks only
        return None
    model_config = run.model_config
    if run.task == "sequence-classification" and model_config.get_text_config().pad_token_id is None:
        labels = [model_config.id2label[i] for i in range(model_config.num_labels)]
        classifier.configure(model_config, labels, pad_token_id=run.tokenizer.pad_token_id)  # batches of several rows
    measures = evaluation.measures_for(run.task, config.metrics)
    if run.task == "sequence-classification" or measures.perplexity:  # rows cut at max_length; prompts are not
        check_example_fits_positions(model_config, config.max_length)
    return measures


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(EvalConfig, argv)
    run = run_lib.start_evaluation(
        config,
        name="eval",
        task=config.task,  # accelerator, every check before loading
        base_model_name_or_path=config.base_model_name_or_path,
    )
    accelerator, tokenizer, task, model_config = run.accelerator, run.tokenizer, run.task, run.model_config
    measures = run.on_every_rank(lambda: prepare_measures(run, config))  # None: lm-eval's tasks only
    metrics = measures.metrics if measures else {}

    # --- data ----------------------------------------------------------------------------------------------------------
    def prepare_data() -> tuple[str | None, dict]:
        if measures is None:
            return None, {}
        data, split = files.evaluation_split(
            files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture),
            config.dataset_split,
        )
        data = data.select(range(min(config.max_eval_samples, len(data)))) if config.max_eval_samples else data
        if task == "sequence-classification":
            rows = classification.rows_for_trained_classes(
                data,
                tokenizer,
                model_config.id2label,
                text_column=config.text_column,
                text_pair_column=config.text_pair_column,
                label_column=config.label_column,
                max_length=config.max_length,
                num_proc=config.dataset_num_proc,
            )
            return split, {"classification": rows}
        parts = {}  # (a vision-language model's processor, run.pictures, reads the examples' pictures)
        pictures = dict(pictures=run.pictures, image_roots=files.data_folders(config.dataset_name))
        if measures.perplexity:
            parts["loss"] = held_out.loss_rows(
                data, tokenizer, text_column=config.text_column, max_length=config.max_length,
                num_proc=config.dataset_num_proc, **pictures,
            )[0]  # fmt: skip
        if metrics:
            parts["generation"] = held_out.generation_examples(
                data, tokenizer, backend=config.generation_backend, **pictures
            )
        return split, parts

    split, data = run.on_every_rank(prepare_data, main_process_first=True)
    if split is not None and split != config.dataset_split:
        accelerator.print(f"the dataset has one split, {split!r}, and no {config.dataset_split!r}: evaluating on it")
    batch_size = config.per_device_eval_batch_size
    loader = None
    if "classification" in data:
        loader = classification.eval_dataloader(
            data["classification"], batch_size=batch_size, pad_token_id=tokenizer.pad_token_id
        )
    elif "generation" in data:
        loader = generation_metrics.generation_dataloader(data["generation"], tokenizer, batch_size=batch_size)

    # --- model, sharded as the Accelerate config says -------------------------------------------------------------------
    with model_source.weights_folder(accelerator, run.source) as weights:
        model = run.load_model_from(model_config, run.source.base or weights, task=task, revision=config.model_revision)
        if run.source.base:  # a LoRA adapter (folder or checkpoint): merged into its base, then sharded
            model = adapters.merge_into(model, weights)
        token_loss = losses.TokenLoss(model) if task == "causal-lm" else None  # chunked: no whole-batch logits
        model, *loaders = evaluation.prepare_for_evaluation(accelerator, model, *([loader] if loader else []))

    # --- the measurements -----------------------------------------------------------------------------------------------
    results, benchmark_results = {}, None
    if server_weights := weight_sync.ServerWeights.for_run(run, config, run.output_dir):
        server_weights.push(model, version=0)  # vLLM generates: it gets the evaluated weights (adapter merged)
        server_weights.close()
    if run.benchmarks:  # lm-eval's tasks on the sharded model, the documents split over the ranks
        scores, benchmark_results = run.score_benchmarks(
            model, bootstrap_iters=config.benchmark_bootstrap_iters, log_samples=True
        )
        results.update(scores)
    if "loss" in data:
        loss = evaluation.evaluate_loss(
            accelerator,
            model,
            data["loss"],
            parallel=run.parallel,
            loss_sum=token_loss.loss_sum,
            batch_size=batch_size,
            pad_token_id=tokenizer.pad_token_id,
            pictures=run.pictures,
        )
        results.update(eval_loss=loss, eval_perplexity=math.exp(loss))
    if loaders:
        settings = generation.GenerationSettings(
            config.max_new_tokens, temperature=config.temperature, top_p=config.top_p, batch_size=batch_size,
            seed=config.seed, **generation.backend_options(config), server=run.generation_server,
            pictures=run.pictures,
        )  # fmt: skip
        predict = (
            classifier.predict
            if task == "sequence-classification"
            else generation_metrics.generation_predict(
                tokenizer, settings=settings, do_sample=config.do_sample, synced_gpus=accelerator.num_processes > 1
            )
        )
        shown = "images" in data.get("generation", [{}])[0]  # encoded outside the model's forward: whole weights
        if shown:
            generation.set_up_for_pictures(model, tokenizer.pad_token_id)
        whole = shown or task == "causal-lm" and config.generation_backend in ("paged", "static_compiled")
        reshard = generation.reshard_after_forward(accelerator)
        with generation.weights_gathered(model, enabled=whole, reshard_after_forward=reshard):
            gathered = evaluation.gather_predictions(accelerator, model, loaders[0], predict, parallel=run.parallel)
        results.update(evaluation.compute_metrics(metrics, gathered))
        if task == "sequence-classification" and "f1" in metrics:
            names = [model_config.id2label[i] for i in range(model_config.num_labels)]
            results["eval_f1_per_class"] = classifier.per_class(metrics["f1"], gathered, names)

    # --- results: the tracker, eval_results.json, the predictions, the card's model-index, the Hub ----------------------
    evaluation_results.report(
        run, config, results, split=split, pipeline_tag=modeling.pipeline_tag(task),
        predictions=(gathered["predictions"], gathered["references"]) if loaders else None,
        label_name=model_config.id2label.get if task == "sequence-classification" else str,
        benchmarks=(run.benchmarks, benchmark_results),
    )  # fmt: skip


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
