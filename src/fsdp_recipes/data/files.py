"""Loading a dataset: a Hub id, a local data file, or a local folder of them, and the held-out split.

Format-independent: each recipe's format module (e.g. `fsdp_recipes.data.chat`) checks the columns it needs. A `.txt`
file is one example with a `text` column (one document, as pretraining wants; use JSONL for many documents per file).
With `streaming=True` nothing is read until iterated, and nothing is written to the datasets cache.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset

from ..errors import DataError

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
_ONE_DOCUMENT_PER_TEXT_FILE = {"sample_by": "document"}  # datasets' default cuts a text file at every line


def load_raw_dataset(dataset_name: str, dataset_config: str | None = None, *,
                     streaming: bool = False) -> DatasetDict | IterableDatasetDict:
    """A Hub dataset id, a local data file, or a local folder of data files (all splits it has)."""
    path = Path(dataset_name)
    if path.is_file():
        builder = _LOCAL_FORMATS.get(path.suffix)
        if builder is None:
            raise DataError(f"{dataset_name}: unsupported file type {path.suffix!r}; use one of {sorted(_LOCAL_FORMATS)}")
        if path.stat().st_size == 0:
            raise DataError(f"{dataset_name} is empty: there is nothing to train on. Point dataset_name at the data.")
        options = _ONE_DOCUMENT_PER_TEXT_FILE if builder == "text" else {}
        return load_dataset(builder, data_files={"train": str(path)}, streaming=streaming, **options)
    if path.is_dir() and any(path.rglob("*.txt")):
        return load_dataset(dataset_name, dataset_config, streaming=streaming, **_ONE_DOCUMENT_PER_TEXT_FILE)
    return load_dataset(dataset_name, dataset_config, streaming=streaming)


def split_train_eval(
    raw: DatasetDict, train_split: str, test_split: str | None, eval_split_size: float, seed: int
) -> tuple[Dataset, Dataset | None]:
    if train_split not in raw:
        raise DataError(f"the dataset has no split {train_split!r} (it has {sorted(raw)}); set dataset_train_split")
    train = raw[train_split]
    if test_split and test_split in raw:
        return train, raw[test_split]
    if eval_split_size > 0 and len(train) > 1:
        parts = train.train_test_split(test_size=eval_split_size, seed=seed)
        return parts["train"], parts["test"]
    return train, None


