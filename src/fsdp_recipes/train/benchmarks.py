"""lm-evaluation-harness benchmarks (GSM8K, MMLU, HellaSwag, a task YAML of your own...) in eval.py and on a
schedule during training: the settings (`BenchmarkFields`, lm-eval's own options under `benchmark_` names) and
`plan`, which resolves the tasks before any weights load: lm-eval importable at the version the API is used from,
every name known (or the closest ones named), every YAML parsed, every task's data loaded, enough documents for the
data-parallel ranks and for the few-shot examples asked. The scoring itself, on the sharded model: `train.benchmark_lm`.

Task names resolve against the tasks shipped here (`benchmark_tasks/`: `demo_reverse`, `demo_first_letter`, over the
demo data), the folders and YAML files the config names, then lm-eval's own catalogue (its index takes seconds to
build, so it is read only for a name found nowhere else)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.metadata
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.parallel_dims import ParallelDims

LM_EVAL_VERSION = "0.4.13"
SHIPPED_TASKS = Path(__file__).parent / "benchmark_tasks"
# what lm-eval's request types need from the model: all of them score or write text with a language-model head
LANGUAGE_MODEL_OUTPUTS = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")


@dataclasses.dataclass
class BenchmarkFields:
    """lm-evaluation-harness tasks to score the model on, with lm-eval's options (its CLI's names after
    `benchmark_`). eval.py scores them once; a training recipe every `benchmark_steps` and at the end."""

    benchmark_tasks: list[str] | None = setting(
        None,
        "lm-evaluation-harness tasks: names (gsm8k, mmlu, hellaswag, ifeval: their data comes from the Hub), task "
        "YAML files or folders of them, or the demo tasks shipped here (demo_reverse, demo_first_letter); each "
        "costs a pass over its documents, split over the data-parallel ranks (null: none)",
        resume="free",
    )
    benchmark_num_fewshot: int | None = setting(
        None,
        "lm-eval's num_fewshot: examples put before each question (null: each task's own default); more shots, "
        "longer prompts",
        resume="free",
        check=checks.at_least(0, or_null=True),
    )
    benchmark_limit: float | None = setting(
        None,
        "lm-eval's limit: the first N documents of each task (>= 1), or that fraction of them (< 1); null: all. "
        "Fewer documents, a cheaper but noisier score",
        resume="free",
    )
    benchmark_apply_chat_template: bool = setting(
        False,
        "lm-eval's apply_chat_template: questions rendered with the tokenizer's chat template (chat models; "
        "the demo's model answers only in its chat format)",
        resume="free",
    )
    benchmark_gen_kwargs: dict[str, Any] | None = setting(
        None,
        "lm-eval's gen_kwargs for generation tasks, over each task's own (e.g. {max_gen_toks: 256, temperature: 0})",
        resume="free",
    )

    def cross_field_problems(self) -> list[str]:
        problems = []
        limit = self.benchmark_limit
        if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
            problems.append(
                f"benchmark_limit must be a whole number of documents >= 1 or a fraction in (0, 1), got {limit}"
            )
        if self.benchmark_tasks is not None and (
            not self.benchmark_tasks or len(set(self.benchmark_tasks)) != len(self.benchmark_tasks)
        ):
            problems.append(f"benchmark_tasks must name each task once, got {self.benchmark_tasks}")
        return problems


@dataclasses.dataclass
class TaskInfo:
    """What the card and the checks need to know of one resolved task."""

    name: str
    output_type: str
    documents: int  # after benchmark_limit
    dataset: str  # the Hub id or the local data's name, for the card's model-index
    split: str | None


@dataclasses.dataclass
class BenchmarkPlan:
    """The resolved tasks: what `train.benchmark_lm.score` hands lm-eval (`specs` and `task_manager`), with lm-eval's
    options from the config."""

    specs: list[str]
    tasks: list[TaskInfo]
    task_manager: Any
    num_fewshot: int | None
    limit: float | None
    apply_chat_template: bool
    gen_kwargs: dict[str, Any] | None

    @property
    def generates(self) -> bool:
        return any(task.output_type == "generate_until" for task in self.tasks)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs every task it indexes and loads at INFO and warns on things the checks here cover: its logger is
    lowered to errors while it works, and restored."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_lm_eval() -> None:
    """ConfigError unless lm-eval is installed at a version with the API used here."""
    try:
        installed = importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    fix = (
        f"install lm-eval=={LM_EVAL_VERSION} (it is in requirements.txt: make venv, or pip install -r requirements.txt)"
    )
    if installed is None:
        raise ConfigError(f"benchmark_tasks needs lm-evaluation-harness, which is not installed: {fix}")
    try:
        from lm_eval import simple_evaluate  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
        from lm_eval.tasks import TaskManager

        TaskManager.load  # noqa: B018 (the flat loader, new in 0.4.10)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"benchmark_tasks: lm-eval {installed} lacks the API this project uses ({error}): {fix}"
        ) from None


def _parse_yaml(path: Path) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        load_yaml(path, resolve_func=False)
    except Exception as error:  # yaml's errors, a missing include, a non-mapping document
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"benchmark_tasks: the task YAML {path} does not parse: {first}") from None


def _specs_and_paths(tasks: list[str]) -> tuple[list[str], list[Path]]:
    """Each entry as lm-eval takes it (a name, or a YAML file's path), and the folders to index."""
    specs, folders = [], [SHIPPED_TASKS]
    for entry in tasks:
        path = Path(entry)
        looks_like_path = entry.endswith((".yaml", ".yml")) or "/" in entry
        if path.is_dir():
            yamls = sorted(path.rglob("*.yaml")) + sorted(path.rglob("*.yml"))
            if not yamls:
                raise ConfigError(f"benchmark_tasks: the folder {entry} holds no task YAML (*.yaml)")
            for yaml_path in yamls:
                _parse_yaml(yaml_path)
                specs.append(str(yaml_path))
            folders.append(path)
        elif path.is_file():
            _parse_yaml(path)
            specs.append(str(path))
            folders.append(path.parent)  # the file's `include:`s and sibling groups resolve there
        elif looks_like_path:
            raise ConfigError(
                f"benchmark_tasks: the task YAML {entry} does not exist (a path, relative to {Path.cwd()})"
            )
        else:
            specs.append(entry)
    return specs, folders


def _task_manager(specs: list[str], folders: list[Path]):
    """lm-eval's TaskManager over the folders here; its own catalogue too only when a name is found nowhere else."""
    from lm_eval.tasks import TaskManager

    names = [spec for spec in specs if not Path(spec).is_file()]
    local = TaskManager(include_path=[str(folder) for folder in folders], include_defaults=False)
    if all(local.match_tasks([name]) for name in names):
        return local
    manager = TaskManager(include_path=[str(folder) for folder in folders])
    for name in names:
        if not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f"the closest: {', '.join(close)}" if close else "lm_eval ls tasks lists them"
            raise ConfigError(
                f"benchmark_tasks: {name!r} is not an lm-eval task, a shipped one or a YAML file ({hint})"
            )
    return manager


def _dataset_of(task) -> str:
    path, kwargs = task.config.dataset_path, task.config.dataset_kwargs or {}
    if path in ("json", "csv", "parquet", "text") and kwargs.get("data_files"):
        files = kwargs["data_files"]
        first = next(iter(files.values())) if isinstance(files, dict) else files
        first = first[0] if isinstance(first, list) else first
        return Path(str(first)).parent.name or str(first)
    return str(path)


def _fewshot_problem(task, name: str, shots: int) -> str | None:
    pool = task.fewshot_docs()
    if pool is None:
        return None
    size = len(pool)
    eval_split = task.config.test_split if task.has_test_docs() else task.config.validation_split
    pool_split = task.config.fewshot_split or (
        task.config.training_split
        if task.has_training_docs()
        else task.config.validation_split
        if task.has_validation_docs()
        else task.config.test_split
    )
    usable = size - 1 if pool_split == eval_split else size  # a question is never its own example
    if shots > usable:
        return (
            f"benchmark_num_fewshot {shots} is more than task {name}'s {usable} few-shot examples (split "
            f"{pool_split!r}): lower benchmark_num_fewshot, or give the task a larger fewshot_split"
        )
    return None


def plan(config, *, parallel: ParallelDims, language_model: bool) -> BenchmarkPlan | None:
    """On every rank, before weights load: the config's `benchmark_tasks` resolved, their data loaded and checked
    (None without tasks). ConfigError for what a user can fix."""
    if not config.benchmark_tasks:
        return None
    require_lm_eval()
    if parallel.sp > 1:
        raise ConfigError(
            "benchmark_tasks under sequence parallelism (sp > 1): lm-eval's forwards take whole rows, which this "
            "layout splits by position; score the exported model with recipes/eval.py on a config without SP"
        )
    data_parallel_size = parallel.data_parallel_size
    if not language_model:
        raise ConfigError(
            "benchmark_tasks: lm-eval's tasks score text with a language-model head (log-likelihoods, generation); "
            "this model is a sequence classifier: score it with `metrics` instead, or leave benchmark_tasks unset"
        )
    from lm_eval.evaluator_utils import get_sample_size

    specs, folders = _specs_and_paths(config.benchmark_tasks)
    with quiet_lm_eval(), contextlib.redirect_stderr(io.StringIO()):
        manager = _task_manager(specs, folders)
        try:
            loaded = manager.load(specs)["tasks"]
        except Exception as error:  # a missing data file, a Hub dataset offline, a template that fails
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"benchmark_tasks {config.benchmark_tasks}: a task could not be loaded: {message} (a task's data "
                "files are read relative to the folder the run starts in; Hub tasks download theirs: they need "
                "internet, or the data already in the cache, which HF_HUB_OFFLINE=1 reads without waiting)"
            ) from None
    infos = []
    for name, task in loaded.items():
        documents = len(task.eval_docs)
        limit = get_sample_size(task, config.benchmark_limit)
        counted = min(documents, limit) if limit is not None else documents
        if counted < data_parallel_size:
            raise ConfigError(
                f"benchmark_tasks: task {name} has {counted} document(s) to score, fewer than the "
                f"{data_parallel_size} data-parallel ranks it is split over: raise benchmark_limit, or score it on "
                "fewer processes"
            )
        output_type = task.OUTPUT_TYPE
        if output_type not in LANGUAGE_MODEL_OUTPUTS:
            raise ConfigError(
                f"benchmark_tasks: task {name}'s output type {output_type} is not one lm-eval's HF model runs"
            )
        shots = config.benchmark_num_fewshot
        if shots and (problem := _fewshot_problem(task, name, shots)):
            raise ConfigError(problem)
        split = task.config.test_split if task.has_test_docs() else task.config.validation_split
        infos.append(TaskInfo(name, output_type, counted, _dataset_of(task), split))
    return BenchmarkPlan(
        specs=specs,
        tasks=infos,
        task_manager=manager,
        num_fewshot=config.benchmark_num_fewshot,
        limit=config.benchmark_limit,
        apply_chat_template=config.benchmark_apply_chat_template,
        gen_kwargs=config.benchmark_gen_kwargs,
    )


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        return None
