"""recipes/pretrain.py and fsdp_recipes.data.text: packing that keeps documents apart, ranks that read disjoint parts of
the corpus, a data position that resumes exactly, and bad input.

Everything that needs no processes runs here, in-process (the data pipeline with explicit rank / world-size
arguments, the recipe's `main` for errors raised before weights load). Three 2-process launches, shared by the slow
tests: a streaming run, the same run killed after step 6, and its resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import packing, text
from fsdp_recipes.data.rows import IGNORE_INDEX
from helpers.data import write_jsonl, write_tiny_model_config
from helpers.launch import concurrently, launch, require_success
from helpers.paths import FSDP_CPU_CONFIG, REPO, TOKENIZER
from helpers.recipes import load_recipe, read_metrics, recipe_config, recipe_error_in_process

PRETRAIN = REPO / "recipes" / "pretrain.py"
STORIES = sorted((REPO / "demo" / "assets" / "text").glob("train-*.jsonl"))


class Documents:
    """A finite document source, as the packer reads one."""

    def __init__(self, documents):
        self.documents, self.index, self.epoch = list(documents), 0, 0

    def next_document(self):
        self.index += 1
        return self.documents[self.index - 1] if self.index <= len(self.documents) else None

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def numbered_documents(lengths):
    """Document d's token j is 1000 * (d + 1) + j: each token says which document it is from and where."""
    return [[1000 * (d + 1) + j for j in range(length)] for d, length in enumerate(lengths)]


def all_rows(packer, source):
    rows = []
    while (row := packer.next_row(source)) is not None:
        rows.append(row)
    return rows


LENGTHS = [5, 30, 3, 17, 16, 1, 40, 9, 16, 2]  # longer than a row of 16 (30, 17, 40), exactly a row, a single token


@pytest.mark.parametrize("strategy", ["wrapped", "bfd"])
def test_no_target_crosses_a_document_and_none_is_lost(strategy):
    documents = numbered_documents(LENGTHS)
    rows = all_rows(packing.Packer(16, strategy), Documents(documents))
    targets_seen = []
    for row in rows:
        ids, targets, positions = row["input_ids"], row["targets"], row["position_ids"]
        assert len(ids) == len(targets) == len(positions) <= 16
        for i, (token, target) in enumerate(zip(ids, targets)):
            if target != IGNORE_INDEX:
                assert target == token + 1, (strategy, row)  # the next token of the same document, nothing else
                targets_seen.append(target)
            # positions restart wherever a document (or its continuation) starts, and count up within it
            continues = i > 0 and token == ids[i - 1] + 1
            assert positions[i] == (positions[i - 1] + 1 if continues else 0), (strategy, row)
    # every token but each document's first is a target exactly once: cuts at row ends lose none
    assert sorted(targets_seen) == sorted(t for document in documents for t in document[1:])
    if strategy == "wrapped":
        assert [len(row["input_ids"]) for row in rows] == [16] * (sum(LENGTHS) // 16) + [sum(LENGTHS) % 16]
    else:  # whole documents: only the one longer than a row is cut
        pieces = [(row["input_ids"][i], n) for row in rows for i, n in enumerate(row["position_ids"]) if n == 0]
        assert len(pieces) == sum(-(-n // 16) for n in LENGTHS)  # e.g. 40 tokens -> 16 + 16 + 8
        assert len(rows) < len(LENGTHS)  # fitted together


def test_cross_document_attention_is_the_classic_concatenated_lm():
    documents = numbered_documents(LENGTHS)
    stream = [t for document in documents for t in document]
    rows = all_rows(packing.Packer(16, "wrapped", cross_document_attention=True), Documents(documents))
    assert [t for row in rows for t in row["input_ids"]] == stream
    for index, row in enumerate(rows):
        assert row["position_ids"] == list(range(len(row["input_ids"])))
        start = index * 16
        assert row["targets"] == (stream[start + 1 : start + 17] + [IGNORE_INDEX])[: len(row["input_ids"])]


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_packed_row_gives_each_document_the_logits_it_has_alone(tmp_path, tokenizer, attn_implementation):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(write_tiny_model_config(tmp_path / "config.json", tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist() for n in (7, 30, 4, 11, 20)]
    for strategy in ("wrapped", "bfd"):
        rows = all_rows(packing.Packer(24, strategy), Documents(documents))
        batch = text.rows_lib.collate_rows(rows, tokenizer.pad_token_id)
        with torch.no_grad():
            # as losses.causal_lm_loss_sum calls it: with a cache, transformers would not look for packed documents
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            checked = 0
            for r, row in enumerate(rows):
                starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
                for start, end in zip(starts, starts[1:]):
                    alone = model(input_ids=torch.tensor([row["input_ids"][start:end]])).logits[0]
                    torch.testing.assert_close(packed[r, start:end], alone, atol=2e-5, rtol=1e-4)
                    checked += 1
        assert checked >= len(documents) + 1  # every document, and the continuation of one cut at a row end


# ------------------------------------------------------------------------------------------------ ranks and position
def write_corpus(folder: Path, shards: int, documents: int = 60) -> list[str]:
    """`documents` distinct short stories in `shards` JSONL shards (document i in shard i % shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    stories = [json.loads(line)["text"] for line in STORIES[0].read_text().splitlines()]
    texts = [f"Story {i}. {stories[i % len(stories)]}" for i in range(documents)]
    for shard in range(shards):
        write_jsonl(folder / f"train-{shard:05d}-of-{shards:05d}.jsonl", [{"text": t} for t in texts[shard::shards]])
    return texts


def tokenized_corpus(folder: Path, tokenizer, *, streaming: bool):
    train, _ = text.load_corpus(
        str(folder),
        None,
        text_field="text",
        streaming=streaming,
        train_split="train",
        test_split=None,
        eval_split_size=0,
        seed=0,
    )
    return text.tokenize(train, tokenizer, "text")


@pytest.mark.parametrize(
    "streaming, shards, split",
    [
        (True, 2, "1 whole shard(s) of 2 per rank"),
        (True, 3, "one document in 2 (3 shards do not divide among 2 processes)"),
        (False, 3, "a contiguous block of documents per rank, in a new seeded order each epoch"),
    ],
)
def test_two_ranks_read_disjoint_documents_that_cover_the_epoch(tmp_path, tokenizer, streaming, shards, split):
    texts = write_corpus(tmp_path / "corpus", shards)
    tokenized = tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=streaming)
    read = []
    for rank in range(2):
        source, summary = text.rank_documents(tokenized, rank=rank, world_size=2, seed=3, max_length=64)
        assert summary["split"] == split
        epoch_zero = []
        while (document := source.next_document()) is not None and source.epoch == 0:
            epoch_zero.append(tokenizer.decode(document, skip_special_tokens=True))
        epoch_one = [tokenizer.decode(document, skip_special_tokens=True)]
        while len(epoch_one) < len(epoch_zero):
            epoch_one.append(tokenizer.decode(source.next_document(), skip_special_tokens=True))
        assert len(set(epoch_zero)) == len(epoch_zero) and sorted(epoch_one) == sorted(epoch_zero)  # once per epoch
        assert (epoch_one != epoch_zero) == (not streaming)  # a map-style corpus is reordered every epoch
        read.append(epoch_zero)
        if not streaming:
            assert summary["documents_per_rank"][rank] == len(epoch_zero)
    assert not set(read[0]) & set(read[1])
    assert sorted(read[0] + read[1]) == sorted(texts)
    assert abs(len(read[0]) - len(read[1])) <= 1


def stream(tokenized, tokenizer, *, strategy, rank=0, world_size=1, max_length=32, **settings):
    source, _ = text.rank_documents(tokenized, rank=rank, world_size=world_size, seed=3, max_length=max_length)
    return text.PackedStream(
        source,
        packing.Packer(max_length, strategy),
        batch_size=3,
        pad_token_id=tokenizer.pad_token_id,
        device="cpu",
        settings={"max_length": max_length, **settings},
    )


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map-style"])
@pytest.mark.parametrize("strategy", ["wrapped", "bfd"])
def test_a_stream_restored_from_its_state_continues_bit_for_bit(tmp_path, tokenizer, streaming, strategy):
    """Saved mid-epoch (leftover tokens pending, or a window half handed out) and on each side of the end of the
    epoch, restored from JSON into a new stream over a new dataset object (as in a new process), then read on."""
    write_corpus(tmp_path / "corpus", 3, documents=24)
    original = stream(
        tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=streaming),
        tokenizer,
        strategy=strategy,
        rank=1,
        world_size=2,
    )
    expected, epochs = [], []
    for _ in range(40):
        expected.append(original.next_batch())
        epochs.append(original.epoch)
    boundary = epochs.index(1)  # the batch during which this rank's part ran out
    for saved_after in (5, boundary, boundary + 1, boundary + 2):
        first = stream(
            tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=streaming),
            tokenizer,
            strategy=strategy,
            rank=1,
            world_size=2,
        )
        first.take(saved_after)
        state = json.loads(json.dumps(first.state_dict()))
        restored = stream(
            tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=streaming),
            tokenizer,
            strategy=strategy,
            rank=1,
            world_size=2,
        )
        restored.load_state_dict(state)
        for step, (a, b) in enumerate(zip(expected[saved_after:], restored.take(len(expected) - saved_after))):
            for key in a:
                assert torch.equal(a[key], b[key]), (saved_after, step, key)
        assert restored.counts() == original.counts()
    with pytest.raises(DataError, match="max_length: 32 then, 48 now"):
        stream(
            tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=streaming),
            tokenizer,
            strategy=strategy,
            max_length=48,
            rank=1,
            world_size=2,
        ).load_state_dict(state)


def test_a_text_file_is_one_document(tmp_path):
    from fsdp_recipes.data import files

    (tmp_path / "a.txt").write_text("first line\nsecond line\n\nthird")
    (tmp_path / "b.txt").write_text("another document")
    assert sorted(files.load_raw_dataset(str(tmp_path))["train"]["text"]) == [
        "another document",
        "first line\nsecond line\n\nthird",
    ]


# ---------------------------------------------------------------------------------------------------- bad input
def run_failing(tmp: Path, values: dict, capsys) -> str:
    """The recipe's main in this process, under the same wrapper as `python recipes/pretrain.py`: its one error."""
    return recipe_error_in_process("pretrain", tmp, values, capsys)


@pytest.fixture
def values(tmp_path, tiny_model_config):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    return dict(
        model_config=str(tiny_model_config),
        tokenizer_name_or_path=str(TOKENIZER),
        dataset_name=str(corpus),
        max_length=64,
        max_steps=3,
        per_device_train_batch_size=2,
        output_dir=str(tmp_path / "out"),
        report_to="none",
        seed=7,
    )


@pytest.mark.parametrize("streaming", [True, False])
def test_missing_text_column_names_the_columns(tmp_path, values, capsys, streaming):
    write_jsonl(tmp_path / "body.jsonl", [{"body": "some text", "id": i} for i in range(4)])
    values.update(dataset_name=str(tmp_path / "body.jsonl"), streaming=streaming)
    error = run_failing(tmp_path, values, capsys)
    assert "columns ['body', 'id'] but no 'text' column" in error and "dataset_text_field" in error
    assert not Path(values["output_dir"]).exists()


def test_empty_corpus(tmp_path, values, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    values["dataset_name"] = str(tmp_path / "empty.jsonl")
    assert "empty.jsonl is empty" in run_failing(tmp_path, values, capsys)
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": None}])
    values.update(dataset_name=str(tmp_path / "blank.jsonl"), streaming=True)
    error = run_failing(tmp_path, values, capsys)
    assert "rank 0's part of it holds 0 tokens (no documents" in error
    assert not Path(values["output_dir"]).exists()


def test_an_empty_file_among_a_streams_shards_is_named(tmp_path, tokenizer):
    """2 processes reading whole files of a 4-file stream: rank 1's two files are empty (one 0 bytes, one only empty
    texts). Said by file, not as rank 1 holding 0 tokens; the corpus as 1 process reads it is fine."""
    write_corpus(tmp_path / "corpus", 4)
    (tmp_path / "corpus" / "train-00001-of-00004.jsonl").write_text("")
    write_jsonl(tmp_path / "corpus" / "train-00003-of-00004.jsonl", [{"text": ""}])
    tokenized = tokenized_corpus(tmp_path / "corpus", tokenizer, streaming=True)
    text.rank_documents(tokenized, rank=0, world_size=2, seed=3, max_length=64)
    with pytest.raises(DataError) as error:
        text.rank_documents(tokenized, rank=1, world_size=2, seed=3, max_length=64, dataset_name=str(tmp_path))
    corpus = tmp_path / "corpus"
    assert str(error.value).startswith(
        f"{corpus / 'train-00001-of-00004.jsonl'}, {corpus / 'train-00003-of-00004.jsonl'} hold no documents (an empty "
        "file, or only empty texts), and the stream is split by whole files (2 of 4 per process): rank 1's files hold "
        "0 tokens, less than one row (max_length=64). Remove the empty file(s)"
    )
    text.rank_documents(tokenized, rank=0, world_size=1, seed=3, max_length=64)


@pytest.mark.parametrize("streaming", [True, False])
def test_corpus_shorter_than_one_row(tmp_path, values, capsys, streaming):
    write_jsonl(tmp_path / "short.jsonl", [{"text": "tiny"}, {"text": "story"}])
    values.update(dataset_name=str(tmp_path / "short.jsonl"), streaming=streaming, eval_split_size=0)
    error = run_failing(tmp_path, values, capsys)
    assert "holds 11 tokens, less than one row (max_length=64)" in error and "smaller max_length" in error
    assert not Path(values["output_dir"]).exists()


def test_tokenizer_without_eos(tmp_path, values, capsys):
    bare = tmp_path / "tokenizer"
    bare.mkdir()
    for file in TOKENIZER.iterdir():
        (bare / file.name).write_bytes(file.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    values["tokenizer_name_or_path"] = str(bare)
    error = run_failing(tmp_path, values, capsys)
    assert "has no EOS token" in error and "tokenizer_name_or_path" in error
    assert not Path(values["output_dir"]).exists()


def test_config_problems_are_reported_together(tmp_path, values):
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.common.errors import ConfigError

    values.update(streaming=True, max_steps=-1, packing_strategy="bfd", cross_document_attention=True)
    with pytest.raises(ConfigError) as error:
        parse_config(
            load_recipe("pretrain").PretrainConfig, ["--config", str(recipe_config(tmp_path / "r.yaml", **values))]
        )
    assert [p.split(":")[0] for p in error.value.problems] == [
        "cross_document_attention needs packing_strategy",
        "streaming",
    ]


def fake_checkpoint(output_dir: Path, model_config: Path, *, rank_state: dict | None = None, **progress) -> Path:
    folder = output_dir / "checkpoints" / "step-00000004"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(model_config.read_text())
    record = dict(
        step=4,
        epoch=0,
        batches_into_epoch=4,
        world_size=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        data_state_per_rank=True,
    )
    record.update(progress)
    (folder / "progress.json").write_text(json.dumps(record))
    if rank_state is not None:
        (folder / "data_state_0.json").write_text(json.dumps(rank_state))
    (output_dir / "checkpoints" / "latest").write_text(folder.name + "\n")
    return folder


def test_resume_on_another_number_of_processes_is_refused(tmp_path, values, tiny_model_config, capsys):
    fake_checkpoint(Path(values["output_dir"]), tiny_model_config, world_size=2)
    values["resume_from_checkpoint"] = "latest"
    error = run_failing(tmp_path, values, capsys)
    assert "written by 2 processes x 2 rows, each process keeping its own position" in error
    assert "Resume with --num_processes 2" in error


def test_resume_with_other_data_settings_is_refused(tmp_path, values, tiny_model_config, capsys):
    settings = load_recipe("pretrain").data_settings(load_recipe("pretrain").PretrainConfig(**values), rank=0)
    fake_checkpoint(
        Path(values["output_dir"]), tiny_model_config, rank_state={"settings": {**settings, "packing_strategy": "bfd"}}
    )
    values["resume_from_checkpoint"] = "latest"
    error = run_failing(tmp_path, values, capsys)
    assert "packing_strategy: 'bfd' then, 'wrapped' now" in error
    fake_checkpoint(tmp_path / "other", tiny_model_config)  # a checkpoint without per-rank data positions
    values["resume_from_checkpoint"] = str(tmp_path / "other" / "checkpoints" / "step-00000004")
    values["output_dir"] = str(tmp_path / "new_out")
    assert "holds no data position for rank 0 (data_state_0.json)" in run_failing(tmp_path, values, capsys)


# ---------------------------------------------------------------------------------------- 2-process launches (3)
STEPS, KILLED_AFTER = 12, 7  # killed before step 7 is logged: steps 5 and 6 are done twice


@pytest.fixture(scope="module")
def launches(tmp_path_factory, tiny_model_config):
    """A streaming run over 3 shards (every other document per rank) that passes the end of its epoch; the same run
    SIGKILLed after step 7 (its latest checkpoint is step 4's); the killed run resumed."""
    tmp = tmp_path_factory.mktemp("pretrain")
    corpus = tmp / "corpus"
    write_corpus(corpus, 3, documents=24)
    write_jsonl(corpus / "test.jsonl", [{"text": "Story x. A held-out story about a fox."}] * 3)

    def run(name, out, env=None, **overrides):
        values = dict(
            model_config=str(tiny_model_config),
            tokenizer_name_or_path=str(TOKENIZER),
            dataset_name=str(corpus),
            streaming=True,
            max_length=64,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            warmup_steps=2,
            logging_steps=1,
            save_steps=4,
            output_dir=str(out),
            seed=7,
        )
        values.update(overrides)
        return launch(
            PRETRAIN,
            ["--config", str(recipe_config(tmp / f"{name}.yaml", **values))],
            accelerate_config=FSDP_CPU_CONFIG,
            env=env,
        )

    reference, killed = concurrently(  # side by side: independent runs
        lambda: run("reference", tmp / "reference"),
        lambda: run("killed", tmp / "resumed", env={"FSDP_RECIPES_FAULT": f"kill-after-step:{KILLED_AFTER}"}),
    )
    require_success(reference)
    assert killed.returncode != 0
    killed_log = read_metrics(tmp / "resumed")
    resumed = run("resumed", tmp / "resumed", resume_from_checkpoint="latest")
    require_success(resumed)
    return {"reference": tmp / "reference", "resumed": tmp / "resumed", "killed_log": killed_log, "corpus": corpus}


def losses_by_step(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_run_summary_says_how_the_corpus_was_divided(launches):
    summary = json.loads((launches["reference"] / "run_summary.json").read_text())
    assert summary["recipe"] == "pretrain" and summary["world_size"] == 2
    assert summary["data"] == {"split": "one document in 2 (3 shards do not divide among 2 processes)"}
    assert summary["parameter_placements"] == ["(Shard(dim=0),)"]
    records = read_metrics(launches["reference"])
    read = next(r for r in records if "documents_read_per_rank" in r)
    # 12 steps x 4 rows x 64 tokens per rank, every row full; 24 documents (~5k tokens) run out: a second epoch
    assert read["rows_read_per_rank"] == [48, 48] and read["tokens_read_per_rank"] == [3072, 3072]
    assert max(r["epoch"] for r in records if "loss" in r) == 1
    assert all(r["padding_fraction"] == 0 and r["tokens_per_second"] > 0 for r in records if "loss" in r)


@pytest.mark.slow
def test_killed_streaming_run_resumes_bit_for_bit(launches):
    reference = losses_by_step(read_metrics(launches["reference"]))
    killed = losses_by_step(launches["killed_log"])
    resumed_records = read_metrics(launches["resumed"])
    resumed_at = next(i for i, r in enumerate(resumed_records) if r.get("event") == "resumed")
    assert resumed_records[resumed_at]["step"] == 4
    resumed = losses_by_step(resumed_records[resumed_at:])
    assert sorted(killed) == list(range(1, KILLED_AFTER)) and sorted(resumed) == list(range(5, STEPS + 1))
    for step in range(5, KILLED_AFTER):  # what the killed run did after its checkpoint, done again
        assert resumed[step] == killed[step], step
    for step in range(1, STEPS + 1):
        assert (resumed if step > 4 else killed)[step] == reference[step], step
    assert reference[STEPS] < reference[1]
    from safetensors.torch import load_file

    expected, actual = (load_file(launches[name] / "model.safetensors") for name in ("reference", "resumed"))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    read = [
        next(r for r in read_metrics(launches[name]) if "documents_read_per_rank" in r)
        for name in ("reference", "resumed")
    ]
    assert {k: v for k, v in read[0].items() if k != "step"} == {k: v for k, v in read[1].items() if k != "step"}


@pytest.mark.slow
def test_exported_model_reproduces_the_logged_eval_loss(launches):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.train.losses import causal_lm_loss_sum, count_targets

    folder = launches["reference"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, held_out = text.load_corpus(
        str(launches["corpus"]),
        None,
        text_field="text",
        streaming=False,
        train_split="train",
        test_split="test",
        eval_split_size=0,
        seed=0,
    )
    rows = text.eval_rows(
        text.tokenize(held_out, tokenizer, "text"),
        max_length=64,
        strategy="wrapped",
        cross_document_attention=False,
        limit=None,
    )
    batch = text.rows_lib.collate_rows(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        loss = float(causal_lm_loss_sum(model, batch)) / count_targets(batch)
    logged = [r["eval_loss"] for r in read_metrics(folder) if "eval_loss" in r][-1]
    assert loss == pytest.approx(logged, rel=1e-5)
    assert json.loads((folder / "eval_results.json").read_text())["eval_perplexity"] == pytest.approx(
        torch.tensor(logged).exp().item(), rel=1e-6
    )
