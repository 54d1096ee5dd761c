"""Raw text for pretraining: documents from one text column, tokenised, divided between ranks, and packed into rows in
which no document attends to or predicts another, with a position that a checkpoint holds exactly.

Documents. Each becomes the tokenizer's ids (with BOS where the tokenizer adds one) followed by EOS; empty texts are
skipped. A stream (`streaming`) is read as a `datasets.IterableDataset` and tokenised on the fly: nothing is written
to disk. A map-style corpus is tokenised once by `datasets.map`, whose cache the next run reuses.

Ranks (`datasets.distributed.split_dataset_by_node`). A stream: whole shards per rank when its shard count is a multiple
of the number of processes, else every k-th document. A map-style corpus: a contiguous block of documents per rank,
read in a new seeded order each epoch. Either way no two ranks read the same document and no rank reads one twice in
an epoch. Each rank's documents go on epoch after epoch, so no rank ever runs dry while the others wait for it.

Rows follow data/rows.py: `input_ids`; `targets` shifted within each document, IGNORE_INDEX after its last token;
`position_ids` restarting at 0 with every document; no attention mask, so transformers isolates the documents.
- "wrapped" (concatenate and split): rows of exactly max_length tokens, no padding. A document cut at the end of a row
  goes on in the next one, its positions restarting at 0 there; the last token before the cut keeps its target (the
  first token of the continuation), so no target is lost.
- "bfd": best-fit decreasing over a window of documents (about data/packing.py's _WINDOW_ROWS rows of them): whole documents, only those
  longer than a row are cut; rows are padded.
- `cross_document_attention` (wrapped only): the classic concatenated LM. Positions run 0..max_length-1 along the row
  and the EOS of a document predicts the first token of the next, so every token may attend to unrelated text before
  it; in exchange the mask is plain causal, which every attention kernel runs on its fastest path.

Position. `PackedStream.state_dict()` is JSON: where this rank is in its part of the corpus (the dataset's own
`state_dict` for a stream, an index for a map-style corpus) and the packer's leftover (tokens not yet placed, or the
window of documents to read again), so a run restored from it continues bit for bit. It belongs to one split of the
corpus into ranks: only the same number of processes can continue it.
"""

from __future__ import annotations

import contextlib
import time

import torch
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import files
from fsdp_recipes.data import rows as rows_lib
from fsdp_recipes.data.packing import Packer


def prepare_tokenizer(tokenizer) -> None:
    """DataError without EOS. A tokenizer without a pad token pads with EOS: padding is never attended to (it has its
    own positions) nor trained on (IGNORE_INDEX targets), so its id does not matter."""
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no EOS token, so the end of a document cannot be marked and "
            "packed documents would run into each other. Use a tokenizer that has one, or set it (tokenizer.eos_token "
            "= '...', then save_pretrained) and point tokenizer_name_or_path at the saved folder."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_corpus(
    dataset_name: str,
    dataset_config: str | None,
    *,
    text_field: str,
    streaming: bool,
    train_split: str,
    test_split: str | None,
    eval_split_size: float,
    seed: int,
):
    """(train, held-out or None), each with its text column checked: Datasets, or IterableDatasets when streaming.
    A stream has no held-out part unless it has a test split (carving one out would need its length)."""
    with files.reading(dataset_name):  # a stream's first example may be read here
        raw = files.load_raw_dataset(dataset_name, dataset_config, streaming=streaming)
        if not streaming:
            train, held_out = files.split_train_eval(raw, train_split, test_split, eval_split_size, seed)
        elif train_split not in raw:
            raise DataError(f"the dataset has no split {train_split!r} (it has {sorted(raw)}); set dataset_train_split")
        else:
            train, held_out = raw[train_split], raw[test_split] if test_split and test_split in raw else None
        for dataset in (train, held_out):
            if dataset is not None:
                check_text_column(dataset, text_field)
    return train, held_out


def check_text_column(dataset: Dataset | IterableDataset, text_field: str) -> None:
    columns = dataset.column_names
    if columns is None:  # a stream that does not declare its features: its first example shows them
        first = next(iter(dataset), None)
        columns = [] if first is None else list(first)
    if text_field not in columns:
        raise DataError(
            f"the dataset has columns {sorted(columns)} but no {text_field!r} column holding the documents: set "
            "dataset_text_field to the column with the text"
        )
    files.check_text_column_type(dataset, text_field, split="train", setting="dataset_text_field")


def _tokenize_batch(batch: dict[str, list], tokenizer, text_field: str) -> dict[str, list]:
    texts = [text for text in batch[text_field] if text]  # None or "": nothing to learn
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"] if texts else []
    documents = [ids if ids and ids[-1] == eos else ids + [eos] for ids in encoded]
    return {"input_ids": documents, "length": [len(ids) for ids in documents]}


def tokenize(
    dataset: Dataset | IterableDataset, tokenizer, text_field: str, *, num_proc: int | None = None, name: str = "train"
) -> Dataset | IterableDataset:
    """Documents -> `input_ids` and `length`: on the fly for a stream, once (and cached) for a map-style dataset."""
    options = dict(function=_tokenize_batch, batched=True, fn_kwargs=dict(tokenizer=tokenizer, text_field=text_field))
    if isinstance(dataset, IterableDataset):
        return dataset.select_columns([text_field]).map(remove_columns=[text_field], **options)
    with files.tokenizing(text_field, split=name, setting="dataset_text_field"):
        return dataset.map(remove_columns=dataset.column_names, num_proc=num_proc, desc=f"Tokenizing {name}", **options)


def rank_documents(
    tokenized: Dataset | IterableDataset,
    *,
    rank: int,
    world_size: int,
    seed: int,
    max_length: int,
    rows_per_step: int = 1,
    repeat_small_dataset: bool = False,
    dataset_name: str | None = None,
):
    """This rank's part of the corpus as an endless document source, and how the corpus was divided (for the run
    summary). DataError if a rank's part holds less than one row of tokens (a row would repeat documents), or less than
    the `rows_per_step` rows one optimizer step takes of each rank (every step would repeat documents) unless
    `repeat_small_dataset`, which the summary then notes. `dataset_name`: where a stream reads from, named if a file of
    it cannot be read."""
    part = split_dataset_by_node(tokenized, rank=rank, world_size=world_size)
    step_tokens = rows_per_step * max_length
    if isinstance(tokenized, IterableDataset):
        shards = tokenized.num_shards
        split = {
            "split": f"{shards // world_size} whole shard(s) of {shards} per rank"
            if shards % world_size == 0
            else f"one document in {world_size} ({shards} shards do not divide among {world_size} processes)"
        }
        with _reading(dataset_name, met_by_one_rank=True):
            tokens = {rank: _first_tokens(part, step_tokens)}
        source = StreamedDocuments(part, dataset_name=dataset_name)
    else:
        parts = [split_dataset_by_node(tokenized, rank=r, world_size=world_size) for r in range(world_size)]
        split = {
            "split": "a contiguous block of documents per rank, in a new seeded order each epoch",
            "documents_per_rank": [len(p) for p in parts],
            "tokens_per_rank": [int(sum(p["length"])) for p in parts],
        }
        tokens = dict(enumerate(split["tokens_per_rank"]))
        source = IndexedDocuments(part, seed=seed)
    smallest = min(tokens, key=tokens.get)
    fewest = tokens[smallest]
    split_by_files = (
        isinstance(tokenized, IterableDataset) and world_size > 1 and tokenized.num_shards % world_size == 0
    )
    if fewest < max_length and split_by_files:  # an empty file can leave a rank with nothing: name it
        with _reading(dataset_name, met_by_one_rank=True):
            empty_files = _empty_files_of_rank(tokenized, rank=rank, world_size=world_size)
        if empty_files:
            raise DataError(
                f"{', '.join(empty_files)} {'holds' if len(empty_files) == 1 else 'hold'} no documents (an empty file, "
                f"or only empty texts), and the stream is split by whole files ({tokenized.num_shards // world_size} "
                f"of {tokenized.num_shards} per process): rank {rank}'s files hold {fewest} tokens, less than one row "
                f"(max_length={max_length}). Remove the empty file(s) from the dataset or fill them"
            )
    if fewest < max_length:
        empty = " (no documents: the texts are empty, or there are fewer of them than processes)"
        raise DataError(
            f"the corpus is too small: rank {smallest}'s part of it holds {fewest} tokens{'' if fewest else empty}, "
            f"less than one row (max_length={max_length}), so a row would repeat documents. Use more data, a smaller "
            "max_length, or fewer processes."
        )
    if fewest < step_tokens:
        if not repeat_small_dataset:
            raise DataError(
                f"the corpus is too small: rank {smallest}'s part of it holds {fewest} tokens, less than one optimizer "
                f"step takes of each rank ({rows_per_step} rows of max_length={max_length}: per_device_train_batch_size "
                "x gradient_accumulation_steps), so every step would repeat documents. Use more data, a smaller batch "
                "or max_length, or fewer processes; or set repeat_small_dataset: true to train on repeated copies "
                "(noted in the run summary)"
            )
        split["repeated_data"] = (
            f"rank {smallest}'s part holds {fewest} tokens, less than one step's {step_tokens}: "
            "every step repeats documents"
        )
    return source, split


def _reading(dataset_name: str | None, *, met_by_one_rank: bool = False):
    return files.reading(dataset_name, met_by_one_rank=met_by_one_rank) if dataset_name else contextlib.nullcontext()


def _empty_files_of_rank(tokenized: IterableDataset, *, rank: int, world_size: int) -> list[str]:
    """The files of a stream split by whole shards (rank r reads shards r, r + world_size, ..., as datasets assigns
    them) that this rank reads and that hold no tokens: named by the files datasets reads them from where it says
    (its json, csv, text and parquet readers do), else as "shard i of n"."""
    shards = tokenized.num_shards
    names = _shard_files(tokenized) or [f"shard {i} of {shards}" for i in range(shards)]
    return [
        names[i]
        for i in range(rank, shards, world_size)
        if _first_tokens(tokenized.shard(num_shards=shards, index=i), 1) == 0
    ]


def _shard_files(dataset: IterableDataset) -> list[str] | None:
    """The file each shard of a stream reads, in shard order, or None where datasets does not say (it keeps them in
    the generator's arguments of the iterable the stream starts from: not a public attribute, hence the care)."""
    iterable = getattr(dataset, "_ex_iterable", None)
    while getattr(iterable, "ex_iterable", None) is not None:
        iterable = iterable.ex_iterable
    arguments = getattr(iterable, "kwargs", None) or {}
    for key in ("original_files", "base_files", "files"):
        files_ = arguments.get(key)
        if isinstance(files_, list) and len(files_) == dataset.num_shards and all(isinstance(f, str) for f in files_):
            return list(files_)
    return None


def _first_tokens(documents: IterableDataset, enough: int) -> int:
    """Tokens at the start of a stream, counted up to `enough` (reads no further)."""
    total = 0
    for example in documents:
        total += example["length"]
        if total >= enough:
            break
    return total


class StreamedDocuments:
    """A rank's part of a stream, pass after pass (datasets reorders the shards each epoch, the same way on every rank)."""

    def __init__(self, dataset: IterableDataset, *, dataset_name: str | None = None):
        self.dataset, self.epoch, self._iterator, self._resume_from = dataset, 0, None, None
        self.dataset_name = dataset_name  # named if a file of the stream cannot be read (this rank alone meets it)

    def next_document(self) -> list[int]:
        empty_passes = 0  # a restored position may be at the very end of a pass; two empty ones mean no data
        while empty_passes < 2:
            if self._iterator is None:
                self.dataset.set_epoch(self.epoch)
                self.dataset.load_state_dict(self._resume_from)  # None: from the start (else datasets would keep
                self._iterator, self._resume_from = iter(self.dataset), None  # resuming from the last state loaded)
            with _reading(self.dataset_name, met_by_one_rank=True):
                example = next(self._iterator, None)
            if example is not None:
                return example["input_ids"]
            self.epoch, self._iterator, empty_passes = self.epoch + 1, None, empty_passes + 1
        raise DataError("this rank's part of the stream has no documents: it ended twice in a row without one")

    def state_dict(self) -> dict:
        # before this epoch's pass starts, the dataset still holds the state of an earlier pass (or of a peek at it)
        return {"epoch": self.epoch, "dataset": None if self._iterator is None else self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._iterator, self._resume_from = state["epoch"], None, state["dataset"]


class IndexedDocuments:
    """A rank's block of a map-style corpus, pass after pass, each pass in its own order drawn from (seed, epoch)."""

    def __init__(self, dataset: Dataset, *, seed: int):
        self.dataset, self.seed, self.epoch, self.index = dataset, seed, 0, 0
        self._order, self._order_epoch = None, None

    def next_document(self) -> list[int]:
        if self.index == len(self.dataset):
            self.epoch, self.index = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(len(self.dataset), generator=generator)  # 8 bytes per document
            self._order_epoch = self.epoch
        self.index += 1
        return self.dataset[int(self._order[self.index - 1])]["input_ids"]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


class _OnePass:
    """A finite document source: None after the last document."""

    def __init__(self, documents):
        self._iterator = iter(documents)

    def next_document(self) -> list[int] | None:
        return next(self._iterator, None)

    def state_dict(self) -> None:
        return None


class PackedStream:
    """One rank's training batches, endlessly: `batch_size` rows from `packer` over `source`, collated (data/rows.py)
    and moved to `device`. It has training.BatchStream's interface (`take`, `epoch`, `batches_into_epoch`) and a JSON
    `state_dict` that each checkpoint keeps per rank; `settings` (what shapes the stream) must match on restore."""

    def __init__(self, source, packer: Packer, *, batch_size: int, pad_token_id: int, device, settings: dict):
        self.source, self.packer, self.batch_size = source, packer, batch_size
        self.pad_token_id, self.device, self.settings = pad_token_id, device, settings
        self.rows = self.tokens = self.batches_into_epoch = self._batch_epoch = 0

    @property
    def epoch(self) -> int:
        return self.source.epoch

    def take(self, count: int, window=None) -> list[dict[str, torch.Tensor]]:
        """The next `count` batches; `window` (a metrics.ThroughputWindow) records them and the time spent on them."""
        waiting = time.perf_counter()
        batches = [self.next_batch() for _ in range(count)]
        if window is not None:
            window.data_wait += time.perf_counter() - waiting
            for batch in batches:
                window.add_batch(batch)
        return batches

    def next_batch(self) -> dict[str, torch.Tensor]:
        batch = rows_lib.collate_rows(
            [self.packer.next_row(self.source) for _ in range(self.batch_size)], self.pad_token_id
        )
        if self.source.epoch != self._batch_epoch:
            self._batch_epoch, self.batches_into_epoch = self.source.epoch, 0
        self.batches_into_epoch += 1
        self.rows += self.batch_size
        self.tokens += int(batch["real_tokens"].sum())
        return {key: value.to(self.device) for key, value in batch.items()}

    def counts(self) -> dict[str, int]:
        """What this rank has read and trained on since the run began (resumes included)."""
        return {"documents": self.packer.documents_read, "rows": self.rows, "tokens": self.tokens}

    def state_dict(self) -> dict:
        return {
            "settings": self.settings,
            "source": self.source.state_dict(),
            "packer": self.packer.state_dict(),
            "rows": self.rows,
            "tokens": self.tokens,
            "batch_epoch": self._batch_epoch,
            "batches_into_epoch": self.batches_into_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        changed = [
            f"{key}: {state['settings'].get(key)!r} then, {self.settings.get(key)!r} now"
            for key in sorted(set(self.settings) | set(state["settings"]))
            if state["settings"].get(key) != self.settings.get(key)
        ]
        if changed:
            raise DataError(
                f"the checkpoint's data position belongs to other data settings ({'; '.join(changed)}), so the run "
                "cannot continue where it stopped. Resume with the settings it was written with, or start a new run "
                "in a new output_dir."
            )
        self.source.load_state_dict(state["source"])
        self.packer.load_state_dict(state["packer"], self.source)
        self.rows, self.tokens = state["rows"], state["tokens"]
        self._batch_epoch, self.batches_into_epoch = state["batch_epoch"], state["batches_into_epoch"]


def eval_rows(
    tokenized: Dataset | IterableDataset,
    *,
    max_length: int,
    strategy: str,
    cross_document_attention: bool,
    limit: int | None,
    dataset_name: str | None = None,
) -> list[dict[str, list[int]]] | None:
    """Held-out rows packed as for training, at most `limit` of them (None: all); the same on every rank, which
    evaluate in turn on their share. None if there are none. `dataset_name`: named if a file cannot be read."""
    source, packer, rows = (
        _OnePass(example["input_ids"] for example in tokenized),
        Packer(max_length, strategy, cross_document_attention=cross_document_attention),
        [],
    )
    while limit is None or len(rows) < limit:
        with _reading(dataset_name):
            row = packer.next_row(source)
        if row is None:
            break
        rows.append(row)
    return rows or None
