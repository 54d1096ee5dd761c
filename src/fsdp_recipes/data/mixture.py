"""alignment-handbook's `dataset_mixture`: several datasets (or several splits of one) mixed into one training set.

    dataset_mixture:
      datasets:
        - {id: HuggingFaceTB/smoltalk2, config: SFT, split: everyday_conversations, columns: [messages], weight: 1.0}
        - {id: my/local_folder, split: train_sft, columns: [messages], weight: 0.5}
      seed: 0               # the shuffles below
      test_split_size: 0.1  # a fraction, or a number of rows, held out as the 'test' split (absent: none)

Each dataset is loaded (`datasets.load_dataset(id, config, split=split)`; a local folder laid out like a Hub dataset
loads the same way), cut to `columns`, and weighted as the handbook does: shuffled with `seed` and cut to
`int(len * weight)` rows; a weight above 1 repeats the whole dataset that many times over (the fraction as before).
The parts are concatenated and shuffled with `seed`. The same mixture and seed give the same rows in the same order
on every rank and every run, so a resumed run's data position means the same rows."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset

from fsdp_recipes.common.errors import DataError

_MIXTURE_KEYS = {"datasets", "seed", "test_split_size"}
_DATASET_KEYS = {"id", "config", "split", "columns", "weight"}


def mixture_problems(mixture: Any) -> list[str]:
    """What is wrong with a mixture's own values (no data read): the schema, and weights negative or all zero."""
    if not isinstance(mixture, dict) or not isinstance(mixture.get("datasets"), list) or not mixture["datasets"]:
        return ["dataset_mixture needs a non-empty list under datasets: [{id: ..., split: ..., weight: ...}, ...]"]
    problems = [
        f"dataset_mixture has no key {key!r} (it takes {sorted(_MIXTURE_KEYS)})"
        for key in mixture.keys() - _MIXTURE_KEYS
    ]
    if not isinstance(mixture.get("seed", 0), int):
        problems.append(f"dataset_mixture seed must be an integer, got {mixture['seed']!r}")
    size = mixture.get("test_split_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0):
        problems.append(
            f"dataset_mixture test_split_size must be a fraction in (0, 1) or a number of rows, got {size!r}"
        )
    elif isinstance(size, float) and size >= 1 and size != int(size):
        problems.append(f"dataset_mixture test_split_size {size} is neither a fraction in (0, 1) nor a whole number")
    weights = []
    for index, entry in enumerate(mixture["datasets"]):
        where = f"dataset_mixture datasets[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            problems.append(f"{where} needs an id (a Hub dataset id or a local folder), got {entry!r}")
            continue
        where += f" ({entry['id']})"
        problems += [
            f"{where} has no key {key!r} (it takes {sorted(_DATASET_KEYS)})" for key in entry.keys() - _DATASET_KEYS
        ]
        columns = entry.get("columns")
        if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
            problems.append(f"{where} columns must be a list of column names, got {columns!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(f"{where} weight must be a number, got {weight!r}")
        elif weight < 0:
            problems.append(f"{where} weight is {weight}: weights are the fraction of each dataset kept, >= 0")
        else:
            weights.append(weight)
    if weights and len(weights) == len(mixture["datasets"]) and not any(weights):
        problems.append("dataset_mixture weights are all 0: nothing would be trained on; give one a weight > 0")
    return problems


def load_mixture(mixture: dict) -> DatasetDict:
    """The mixture as a DatasetDict: 'train', and 'test' when `test_split_size` is set."""
    seed = mixture.get("seed", 0)
    parts = [
        _weighted(_load_part(index, entry), entry.get("weight", 1.0), seed)
        for index, entry in enumerate(mixture["datasets"])
    ]
    try:
        mixed = concatenate_datasets([part for part in parts if len(part)]).shuffle(seed=seed)
    except ValueError as error:
        raise DataError(
            f"dataset_mixture: the datasets cannot be concatenated ({error}); give each the same columns with "
            "columns: [...]"
        ) from None
    size = mixture.get("test_split_size")
    if size is None:
        return DatasetDict({"train": mixed})
    if size >= len(mixed) or (size < 1 and int(size * len(mixed)) < 1):
        raise DataError(
            f"dataset_mixture test_split_size {size} leaves no rows on one side of {len(mixed)} mixed rows: "
            "make it smaller, or larger if it is a fraction rounding to no row"
        )
    return mixed.train_test_split(test_size=int(size) if size >= 1 else size, seed=seed)


def _load_part(index: int, entry: dict) -> Dataset:
    name, split, config = entry["id"], entry.get("split", "train"), entry.get("config")
    where = f"dataset_mixture datasets[{index}] ({name}, config {config!r})"
    # datasets caches a local folder's README-declared configs under a key that ignores the files' contents, so an
    # edited file would be read stale (and checked against the stale sizes): a local folder is always read afresh
    local = Path(name).expanduser().is_dir()
    fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks"} if local else {}
    try:
        part = load_dataset(name, config, split=split, **fresh)
    except ValueError as error:  # an unknown split or config
        if "split" in str(error).lower():
            raise DataError(f"{where} has no split {split!r} ({error}); fix its split") from None
        raise DataError(f"{where} could not be loaded: {error}") from None
    except FileNotFoundError as error:
        raise DataError(f"{where} could not be found ({error}); check its id (a Hub id or a local folder)") from None
    columns = entry.get("columns")
    if columns:
        missing = [column for column in columns if column not in part.column_names]
        if missing:
            raise DataError(
                f"{where} split {split!r} has no column {', '.join(map(repr, missing))} (it has {part.column_names}); "
                "fix its columns"
            )
        part = part.select_columns(columns)
    return part


def _weighted(part: Dataset, weight: float, seed: int) -> Dataset:
    """`weight` x the dataset's rows: whole copies, then a seeded shuffle's first rows for the fraction."""
    copies, fraction = int(weight), weight - int(weight)
    shuffled = part.shuffle(seed=seed)
    pieces = [shuffled] * copies + [shuffled.select(range(int(len(part) * fraction)))]
    return concatenate_datasets(pieces)
