"""lm-evaluation-harness in this process: the model class the runs score with (`train.benchmark_lm.ShardedLM`) gives
lm-eval's own HF model's answers, request by request, on the shipped demo tasks (generation with exact match,
multiple choice) and a rolling log-likelihood task; `plan` refuses bad input before weights load. The 2-rank scores
during training, their resume and their equality with `lm_eval --model hf` on the exported folder:
tests/test_checkpoint_resume.py and tests/test_sft_recipe.py, on the shared SFT launches."""

from __future__ import annotations

import json
import math
import types

import pytest

from helpers.benchmark_tasks import rolling_task
from helpers.paths import REPO, TOKENIZER
from helpers.recipes import base_recipe_values, recipe_error_in_process

LIMIT = 12


def settings_of(tasks, **overrides):
    values = dict(
        benchmark_tasks=tasks,
        benchmark_num_fewshot=None,
        benchmark_limit=LIMIT,
        benchmark_apply_chat_template=True,
        benchmark_gen_kwargs=None,
    )
    return types.SimpleNamespace(**(values | overrides))


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A random tiny model (its generations are long and varied: a strict comparison) scored by ShardedLM and by
    lm-eval's HFLM, every request's answer kept."""
    import torch
    from accelerate import Accelerator
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.train import benchmark_lm, benchmarks, generation

    folder = tmp_path_factory.mktemp("benchmarks")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "demo" / "tiny_llama.json", initializer_range=0.3)  # varied answers
    model = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    parallel = ParallelDims.from_environment({})
    plan = benchmarks.plan(
        settings_of(["demo_reverse", "demo_first_letter", rolling_task(folder)]), parallel=parallel, language_model=True
    )
    options = dict(
        tasks=plan.specs, task_manager=plan.task_manager, limit=LIMIT, apply_chat_template=True, bootstrap_iters=0
    )
    ours = benchmark_lm.sharded_lm(
        model, tokenizer, accelerator=Accelerator(cpu=True), parallel=parallel, batch_size=5,
        settings=generation.GenerationSettings(1, batch_size=5),
    )  # fmt: skip
    hf = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=5)
    mine, theirs = simple_evaluate(model=ours, **options), simple_evaluate(model=hf, **options)
    few_shot = dict(options, tasks=["demo_first_letter"], num_fewshot=3)  # examples drawn from the train split
    shots = {"mine": simple_evaluate(model=ours, **few_shot), "theirs": simple_evaluate(model=hf, **few_shot)}
    model.train()  # as a training run holds it: a pass must leave it so, and the random streams where they were
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    figures, full = benchmark_lm.score(
        plan, model, tokenizer, accelerator=Accelerator(cpu=True), parallel=parallel, batch_size=5,
        settings=generation.GenerationSettings(1, batch_size=5),
    )  # fmt: skip
    draw_after = torch.rand(3)
    return dict(
        mine=mine, theirs=theirs, shots=shots, figures=figures, full=full, model=model, plan=plan, training=model.training,
        draws=(expected_draw, draw_after),
    )  # fmt: skip


def flatten(value) -> list[float]:
    """Every number in a nest of answers (multiple choice: (log-likelihood, is greedy) per choice), in order."""
    if isinstance(value, (list, tuple)):
        return [number for part in value for number in flatten(part)]
    return [float(value)]


def answers(results, task):
    return [sample["filtered_resps"] for sample in results["samples"][task]]


def test_generation_tasks_get_lm_evals_own_answers_through_the_runs_generation_backend(scored):
    mine, theirs = answers(scored["mine"], "demo_reverse"), answers(scored["theirs"], "demo_reverse")
    assert len(mine) == LIMIT and mine == theirs
    assert all(answer[0] for answer in mine)  # random weights write something: the comparison is not of empties
    assert scored["mine"]["results"]["demo_reverse"]["exact_match,none"] == 0.0


def test_log_likelihood_tasks_get_lm_evals_own_scores(scored):
    for task in ("demo_first_letter", "reverse_rolling"):
        mine, theirs = answers(scored["mine"], task), answers(scored["theirs"], task)
        assert len(mine) == LIMIT
        assert flatten(mine) == pytest.approx(flatten(theirs), rel=1e-5)
    first_letter = scored["theirs"]["results"]["demo_first_letter"]
    assert scored["figures"]["benchmark/demo_first_letter/acc"] == first_letter["acc,none"]
    assert scored["figures"]["benchmark/reverse_rolling/word_perplexity"] == pytest.approx(
        scored["theirs"]["results"]["reverse_rolling"]["word_perplexity,none"], rel=1e-5
    )


def test_few_shot_prompts_and_their_scores_are_lm_evals_own(scored):
    mine, theirs = scored["shots"]["mine"], scored["shots"]["theirs"]
    prompts = [sample["arguments"] for sample in mine["samples"]["demo_first_letter"]]
    assert prompts == [sample["arguments"] for sample in theirs["samples"]["demo_first_letter"]]
    assert prompts[0][0][0].count("starts") == 4  # three examples, then the question
    assert flatten(answers(mine, "demo_first_letter")) == pytest.approx(
        flatten(answers(theirs, "demo_first_letter")), rel=1e-5
    )


def test_a_pass_leaves_the_model_training_and_the_random_streams_where_they_were(scored):
    import torch

    assert scored["training"]
    expected, drawn = scored["draws"]
    assert torch.equal(expected, drawn)  # lm-eval seeds torch with 1234: the run's stream is kept
    assert scored["figures"]["benchmark_time_s"] > 0
    assert set(scored["full"]["results"]) == {"demo_reverse", "demo_first_letter", "reverse_rolling"}


def test_the_card_names_each_benchmark_with_its_dataset_and_lm_eval_as_its_source(scored):
    from fsdp_recipes.publish.evaluation_results import benchmark_card_results

    results = benchmark_card_results(scored["figures"], scored["plan"])
    named = {(r.dataset_name, r.metric_type): r for r in results}
    assert named["demo_first_letter", "acc"].dataset_type == "first_letter"
    assert named["demo_reverse", "exact_match"].metric_value == 0.0
    assert named["reverse_rolling", "word_perplexity"].metric_value == pytest.approx(
        scored["figures"]["benchmark/reverse_rolling/word_perplexity"]
    )
    assert all(r.source_name.startswith("lm-evaluation-harness 0.4.13") for r in results)
    assert math.isfinite(named["reverse_rolling", "bits_per_byte"].metric_value)


# --- bad input: one error line before weights load ------------------------------------------------------------------
@pytest.fixture
def eval_values(tmp_path, pretrained_tiny_model):
    return dict(model_name_or_path=str(pretrained_tiny_model), output_dir=str(tmp_path / "out"))


def refusal(tmp_path, capsys, values, recipe="eval"):
    return recipe_error_in_process(recipe, tmp_path, values, capsys)


def test_an_unknown_task_is_refused_with_the_closest_names(tmp_path, capsys, eval_values):
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=["hellaswg"]))
    assert "'hellaswg' is not an lm-eval task" in line and "hellaswag" in line


def test_task_yamls_that_do_not_parse_or_whose_data_is_missing_are_refused(tmp_path, capsys, eval_values):
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken\ndoc_to_text: [unclosed\n")
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=[str(broken)]))
    assert f"the task YAML {broken} does not parse" in line
    missing = tmp_path / "missing_data.yaml"
    missing.write_text(
        "task: missing_data\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: /nonexistent/test.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{label}}'\n"
    )
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=[str(missing)]))
    assert "a task could not be loaded" in line and "nonexistent" in line
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=[str(tmp_path / "typo.yaml")]))
    assert "typo.yaml does not exist" in line


def test_more_shots_than_the_pool_and_a_schedule_that_is_not_positive_are_refused(tmp_path, capsys, eval_values):
    line = refusal(
        tmp_path, capsys, eval_values | dict(benchmark_tasks=["demo_first_letter"], benchmark_num_fewshot=5000)
    )
    assert "benchmark_num_fewshot 5000 is more than task demo_first_letter's 2000 few-shot examples" in line
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=["demo_reverse"], benchmark_limit=2.5))
    assert "benchmark_limit must be a whole number of documents" in line


def test_a_classifier_and_a_missing_lm_eval_are_refused(tmp_path, capsys, eval_values, monkeypatch):
    line = refusal(
        tmp_path, capsys, eval_values | dict(benchmark_tasks=["demo_reverse"], task="sequence-classification")
    )
    assert "this model is a sequence classifier" in line
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: (
            (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name)) if name == "lm-eval" else real(name)
        ),
    )
    line = refusal(tmp_path, capsys, eval_values | dict(benchmark_tasks=["demo_reverse"]))
    assert "benchmark_tasks needs lm-evaluation-harness, which is not installed" in line and "lm-eval==0.4.13" in line


def test_a_training_schedule_that_is_not_a_positive_number_of_steps_is_refused(
    tmp_path, capsys, tiny_model_config, small_chat_data
):
    values = base_recipe_values(tiny_model_config, small_chat_data, tmp_path / "out", benchmark_tasks=["demo_reverse"])
    line = refusal(tmp_path, capsys, values | dict(benchmark_steps=0), recipe="sft")
    assert "benchmark_steps must be >= 1" in line and "a positive number of optimizer steps" in line
    line = refusal(tmp_path, capsys, values | dict(benchmark_tasks=None, benchmark_steps=5), recipe="sft")
    assert "benchmark_steps is set but benchmark_tasks is not" in line
    line = refusal(tmp_path, capsys, values | dict(benchmark_tasks=["demo_reverse", "demo_reverse"]), recipe="sft")
    assert "benchmark_tasks must name each task once" in line


def test_eval_py_scores_benchmarks_alone_into_its_results_the_card_and_lm_evals_own_files(
    tmp_path, pretrained_tiny_model, monkeypatch
):
    """No dataset_name: lm-eval's tasks only, scored by eval.py in this process (its documented demo config's
    fields), with lm-eval's output and every document's answers written beside eval_results.json."""
    from helpers.recipes import run_recipe_in_process

    monkeypatch.chdir(REPO)  # the shipped tasks read demo/assets/ from the repository root
    out = tmp_path / "out"
    values = dict(
        model_name_or_path=str(pretrained_tiny_model), output_dir=str(out), benchmark_limit=6,
        benchmark_tasks=["demo_reverse", "demo_first_letter"], benchmark_apply_chat_template=True,
    )  # fmt: skip
    run_recipe_in_process("eval", tmp_path, "benchmarks", values)
    results = json.loads((out / "eval_results.json").read_text())
    assert results["dataset"] is None and results["benchmark/demo_first_letter/acc"] in [i / 6 for i in range(7)]
    lm_eval_output = json.loads((out / "lm_eval_results.json").read_text())
    assert lm_eval_output["results"]["demo_first_letter"]["acc,none"] == results["benchmark/demo_first_letter/acc"]
    samples = [json.loads(line) for line in (out / "lm_eval_samples.jsonl").read_text().splitlines()]
    assert sorted(s["task"] for s in samples) == ["demo_first_letter"] * 6 + ["demo_reverse"] * 6
    assert all(s["doc_id"] in range(6) for s in samples)
    card = (out / "README.md").read_text()
    assert "demo_reverse" in card and "exact_match" in card
