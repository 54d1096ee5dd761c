"""Loading a dataset: a Hub id, a local data file, or a local folder of them, and the held-out split.

Format-independent: each recipe's format module (e.g. `fsdp_recipes.data.chat`) checks the columns it needs. A `.txt`
file is one example with a `text` column (one document, as pretraining wants; use JSONL for many documents per file).
With `streaming=True` nothing is read until iterated, and nothing is written to the datasets cache.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow
from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset
from datasets import config as datasets_config
from datasets.data_files import EmptyDatasetError
from datasets.exceptions import DataFilesNotFoundError, DatasetBuildError, DatasetNotFoundError, DatasetsError
from datasets.table import CastError
from huggingface_hub.errors import HfHubHTTPError

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.mixture import load_mixture

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
_ONE_DOCUMENT_PER_TEXT_FILE = {"sample_by": "document"}  # datasets' default cuts a text file at every line
# What the json, csv and parquet builders raise on a file they cannot read (pandas' and pyarrow's are ValueErrors).
_READ_ERRORS = (DatasetBuildError, pyarrow.ArrowException, ValueError)


@contextlib.contextmanager
def reading(dataset_name: str, *, met_by_one_rank: bool = False) -> Iterator[steps.Step]:
    """The step of reading `dataset_name` (`fsdp_recipes.common.steps`): what a library raises because of a file (not
    UTF-8, not the format its name says, unreadable) becomes one DataError naming the file. Wrap what reads a stream
    too: a streamed dataset is read only when iterated. `met_by_one_rank`: while each rank reads its own part, so the
    rank that met it says so itself."""
    with steps.step(
        f"reading dataset_name {dataset_name!r}",
        name=dataset_name,
        setting="dataset_name",
        explain=_explain_unreadable(dataset_name),
        met_by_one_rank=met_by_one_rank,
    ) as step:
        yield step


def _explain_unreadable(dataset_name: str):
    def explain(error: BaseException, step: steps.Step) -> steps.Problem | None:
        if not isinstance(error, (UnicodeDecodeError, *_READ_ERRORS)):
            return None
        path = Path(dataset_name).expanduser()
        paths = [path] if path.is_file() else _data_files_in(path) if path.is_dir() else []
        for file in paths:
            problem = _file_problem(file)
            if problem is not None:
                fix = (
                    "Fix it, or move it out of the folder" if len(paths) > 1 else f"Fix it, or {step.point_elsewhere()}"
                )
                return steps.Problem(f"{file}: {problem}", fix)
        return None

    return explain


def tokenizing(column: str, *, split: str, setting: str):
    """The step of tokenizing a text column (`fsdp_recipes.common.steps`): values the tokenizer refuses (not text)
    become one error naming the column, the split and the setting that chose it."""
    return steps.step(f"tokenizing column {column!r} of the {split} split ({setting})", name=column, setting=setting)


def check_text_column_type(dataset, column: str, *, split: str, setting: str) -> None:
    """DataError unless `column` holds text: the tokenizer refuses numbers and chat turns, and takes lists of strings
    for words already split (which they are not). A stream that declares no features: its first value is looked at."""
    features = getattr(dataset, "features", None)
    feature = features.get(column) if features else None
    if feature is not None:
        if getattr(feature, "dtype", None) in ("string", "large_string"):
            return
        kind = _feature_kind(feature)
    else:
        first = next(iter(dataset), None) if features is None else None
        value = None if first is None else first.get(column)
        if value is None or isinstance(value, str):
            return
        kind = _value_kind(value)
    raise DataError(
        f"column {column!r} of the {split} split holds {kind}, not text: point {setting} at a column of "
        "strings"
        + (
            " (conversations go in a 'messages' column, read as chat where a recipe takes chat)"
            if "turns" in kind
            else ""
        )
    )


def _feature_kind(feature) -> str:
    inner = getattr(feature, "feature", None)
    if inner is not None:  # a list
        if isinstance(inner, dict) and {"role", "content"} <= set(inner):
            return "chat turns (lists of role/content)"
        return f"lists of {getattr(inner, 'dtype', None) or type(inner).__name__}"
    if isinstance(feature, dict):
        return f"records with keys {sorted(feature)}"
    return getattr(feature, "dtype", None) or type(feature).__name__


def _value_kind(value) -> str:
    if isinstance(value, list) and value and all(isinstance(v, dict) and "role" in v for v in value):
        return "chat turns (lists of role/content)"
    return {list: "lists", dict: "records", bool: "booleans", int: "numbers", float: "numbers"}.get(
        type(value), type(value).__name__
    )


def load_raw_dataset(
    dataset_name: str | None, dataset_config: str | None = None, *, streaming: bool = False, mixture: dict | None = None
) -> DatasetDict | IterableDatasetDict:
    """A Hub dataset id, a local data file, or a local folder of data files (all splits it has); or, given
    `mixture` (alignment-handbook's `dataset_mixture`), its mixed 'train' (and 'test') split."""
    if mixture is not None:
        return load_mixture(mixture)
    with reading(dataset_name):
        return _load_raw_dataset(dataset_name, dataset_config, streaming)


def _load_raw_dataset(
    dataset_name: str, dataset_config: str | None, streaming: bool
) -> DatasetDict | IterableDatasetDict:
    path = Path(dataset_name).expanduser()
    if path.is_file():
        return _load_file(dataset_name, path, streaming)
    if path.is_dir():
        options = _ONE_DOCUMENT_PER_TEXT_FILE if any(path.rglob("*.txt")) else {}
        try:
            return load_dataset(str(path), dataset_config, streaming=streaming, **options)
        except (EmptyDatasetError, DataFilesNotFoundError):  # no files at all, or none of a format datasets reads
            raise DataError(
                f"dataset_name {dataset_name!r} is a folder with no data files in it. Put .jsonl, .json, .parquet or "
                ".csv files there (train.jsonl and test.jsonl give a train and a test split), or point dataset_name "
                "at one file."
            ) from None
        except _READ_ERRORS as error:
            raise _unreadable(_data_files_in(path), dataset_name, error) from None
    if _looks_local(dataset_name):
        raise DataError(
            f"dataset_name {dataset_name!r}: {path.absolute()} does not exist. Fix the path, or give a Hub dataset "
            "id, which looks like org/name."
        )
    return _load_from_hub(dataset_name, dataset_config, streaming)


def data_folders(dataset_name: str | None) -> tuple[Path, ...]:
    """Where relative paths in a local dataset's rows (images) are looked up: the dataset's folder, or its file's
    folder; none for a Hub dataset."""
    path = Path(dataset_name).expanduser() if dataset_name else None
    if path is None or not path.exists():
        return ()
    return (path if path.is_dir() else path.parent,)


def _looks_local(name: str) -> bool:
    return Path(name).suffix.lower() in _LOCAL_FORMATS or not steps.looks_like_hub_id(name)


def _load_file(dataset_name: str, path: Path, streaming: bool) -> DatasetDict | IterableDatasetDict:
    builder = _LOCAL_FORMATS.get(path.suffix)
    if builder is None:
        raise DataError(f"{dataset_name}: unsupported file type {path.suffix!r}; use one of {sorted(_LOCAL_FORMATS)}")
    if path.stat().st_size == 0:
        raise DataError(f"{dataset_name} is empty: there is nothing to train on. Point dataset_name at the data.")
    try:
        options = _ONE_DOCUMENT_PER_TEXT_FILE if builder == "text" else {}
        return load_dataset(builder, data_files={"train": str(path)}, streaming=streaming, **options)
    except _READ_ERRORS as error:
        raise _unreadable([path], dataset_name, error) from None


def _load_from_hub(dataset_name: str, dataset_config: str | None, streaming: bool) -> DatasetDict | IterableDatasetDict:
    # An id like data/train may have been meant as a relative path: say that there is none of that name either.
    also_local = f" (and there is no local folder {dataset_name!r} either)" if "/" in dataset_name else ""
    try:
        return load_dataset(dataset_name, dataset_config, streaming=streaming)
    except DatasetNotFoundError as error:
        raise DataError(
            f"dataset_name {dataset_name!r}: {str(error).rstrip('.')}{also_local}. Check the id (org/name), log in "
            "with `hf auth login` or set HF_TOKEN if it is private or gated, or point dataset_name at a local file "
            "or folder."
        ) from None
    except (ConnectionError, FileNotFoundError, HfHubHTTPError) as error:
        if datasets_config.HF_HUB_OFFLINE:
            reason = "it is not in the local cache and HF_HUB_OFFLINE is set, so the Hub was not asked"
            fix = "Unset HF_HUB_OFFLINE where the Hub can be reached"
        else:
            reason = f"the Hugging Face Hub could not be reached or could not find it ({error})"
            fix = (
                "Check the id (org/name) and the network (if it was downloaded before, HF_HUB_OFFLINE=1 loads the "
                "cached copy)"
            )
        raise DataError(
            f"dataset_name {dataset_name!r} could not be loaded: {reason}{also_local}. {fix}, or point "
            "dataset_name at a local file or folder."
        ) from None


def _data_files_in(folder: Path) -> list[Path]:
    """The data files datasets reads from a folder: hidden files and folders are skipped, as datasets does."""
    return sorted(
        path
        for path in folder.rglob("*")
        if path.suffix.lower() in _LOCAL_FORMATS
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )


def _unreadable(paths: list[Path], dataset_name: str, error: BaseException) -> DataError:
    """The first file that is wrong and what is wrong with it, found by reading the files again (only after the
    datasets loader failed, so good data is read once), or else the reason the loader gave."""
    for path in paths:
        problem = _file_problem(path)
        if problem is not None:
            fix = "Fix it, or move it out of the folder" if len(paths) > 1 else "Fix it"
            return DataError(f"{path}: {problem}. {fix}, then rerun.")
    return DataError(
        f"could not read dataset_name {dataset_name!r}: {_reason(error)}. Check the data files: one format, and the "
        "same columns in every file of a split."
    )


def _reason(error: BaseException) -> str:
    """What went wrong, from the chain below datasets' generic "An error occurred while generating the dataset"."""
    seen = error
    while seen is not None:
        if isinstance(seen, CastError):
            first, other = sorted(seen.requested_column_names), sorted(seen.table_column_names)
            return f"the files of a split do not all have the same columns: some have {first}, others {other}"
        if not isinstance(seen, DatasetsError) or (seen.__cause__ or seen.__context__) is None:
            return " ".join(str(seen).split())
        seen = seen.__cause__ or seen.__context__
    return str(error)


def _file_problem(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _json_lines_problem(path)
    if suffix == ".json":
        return _json_document_problem(path)
    if suffix == ".parquet":
        return _parquet_problem(path)
    if suffix == ".csv":
        return _csv_problem(path)
    if suffix == ".txt":
        return _text_problem(path)
    return None


def _text_problem(path: Path) -> str | None:
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                return f"it is not UTF-8 text (byte {offset + error.start} is not valid UTF-8: a binary file?)"
            offset += len(chunk)
    return None


def _json_lines_problem(path: Path) -> str | None:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number} is not valid JSON ({error.msg}, column {error.colno})"
            except UnicodeDecodeError:
                return f"line {number} is not UTF-8 text"
            if not isinstance(record, dict):
                return _not_an_object(f"line {number}", record)
    return None


def _json_document_problem(path: Path) -> str | None:
    try:
        document = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several values: JSON Lines in a .json file, which datasets reads too
            return _json_lines_problem(path)
        return f"it is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
    except UnicodeDecodeError:
        return "it is not UTF-8 text"
    for index, record in enumerate(document if isinstance(document, list) else []):
        if not isinstance(record, dict):
            return _not_an_object(f"item {index} of the list", record)
    return None


def _not_an_object(where: str, value) -> str:
    kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value))
    return f"{where} is {kind or 'null'}, not an object whose keys are the dataset's columns"


def _parquet_problem(path: Path) -> str | None:
    import pyarrow.parquet

    try:
        for _ in pyarrow.parquet.ParquetFile(path).iter_batches():
            pass
    except (pyarrow.ArrowException, OSError) as error:
        return f"it is not a readable Parquet file ({error})"
    return None


def _csv_problem(path: Path) -> str | None:
    import pandas

    try:
        for _ in pandas.read_csv(path, chunksize=65536):
            pass
    except ValueError as error:  # pandas' ParserError, EmptyDataError and UnicodeDecodeError are ValueErrors
        return f"it is not a readable CSV file ({' '.join(str(error).split())})"
    return None


def split_train_eval(
    raw: DatasetDict, train_split: str, test_split: str | None, eval_split_size: float, seed: int
) -> tuple[Dataset, Dataset | None]:
    """(train, held-out or None): the test split when there is one, else `eval_split_size` of train carved out at
    random (the rows `datasets`' train_test_split would pick), each part remembering its rows' places in the split
    it came from (`row_place`)."""
    if train_split not in raw:
        raise DataError(f"the dataset has no split {train_split!r} (it has {sorted(raw)}); set dataset_train_split")
    train = raw[train_split]
    if test_split and test_split in raw:
        return train, raw[test_split]
    if eval_split_size > 0 and len(train) > 1:
        held_out_count = math.ceil(eval_split_size * len(train))
        order = np.random.default_rng(seed).permutation(len(train))
        parts = train.select(order[held_out_count:]), train.select(order[:held_out_count])
        for part, held_out in zip(parts, (False, True)):
            _CARVED[part._fingerprint] = Carving(train_split, len(train), seed, held_out_count, held_out)
        return parts
    return train, None


@dataclasses.dataclass(frozen=True)
class Carving:
    """How a part was carved out of a split (small: it travels in `Dataset.map`'s arguments); the rows themselves
    are drawn again only to name one in a message."""

    split: str
    size: int
    seed: int
    held_out_count: int
    held_out: bool

    def row(self, index: int) -> int:
        order = np.random.default_rng(self.seed).permutation(self.size)
        return int((order[: self.held_out_count] if self.held_out else order[self.held_out_count :])[index])


_CARVED: dict[str, Carving] = {}


def carving_of(dataset: Dataset) -> Carving | None:
    return _CARVED.get(getattr(dataset, "_fingerprint", None))


def row_place(carving: Carving | None, index: int, name: str) -> str:
    """'<row> of the <split> split' for row `index` of a part named `name`, counted as in the user's data: a part
    carved out of a split by `split_train_eval` names that split and the row's place in it."""
    if carving is None:
        return f"{index} of the {name} split"
    held = " (held out for evaluation)" if carving.held_out else ""
    return f"{carving.row(index)} of the {carving.split} split{held}"


def evaluation_split(raw: DatasetDict, split: str) -> tuple[Dataset, str]:
    """(the split to evaluate, its name): `split`, or the only split of a one-split dataset (a single data file loads
    as 'train'); a dataset with several splits and none named `split` is an error listing them."""
    if split in raw:
        return raw[split], split
    if len(raw) == 1:
        (only,) = raw
        return raw[only], only
    raise DataError(f"the dataset has no split {split!r} (it has {sorted(raw)}); set dataset_split")
