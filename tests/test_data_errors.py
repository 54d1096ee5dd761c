"""Bad data ends in one DataError that names the file, line or example and what is wrong with it, never a
datasets / pyarrow / chat-template traceback. In-process and offline: seconds in all."""

from __future__ import annotations

import json

import datasets
import pytest
from datasets import Dataset

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import files
from fsdp_recipes.data.chat import tokenize_dataset
from fsdp_recipes.data.files import load_raw_dataset
from helpers.data import write_jsonl

TURNS = [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]
GOOD = {"messages": TURNS}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """A name that reaches the Hub fails at once instead of retrying a network this machine may not have."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("name", ["./missing.jsonl", "missing.parquet", "data/train.jsonl", "a/b/c", "~/no-such-x"])
def test_a_local_path_that_does_not_exist(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="does not exist") as raised:
        load_raw_dataset(name)
    assert name in str(raised.value) and "org/name" in str(raised.value)


def test_an_absolute_path_that_does_not_exist(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_raw_dataset(str(tmp_path / "gone"))


def test_a_hub_id_that_cannot_be_found_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as raised:
        load_raw_dataset("no-such-org/no-such-dataset")
    message = str(raised.value)
    assert "'no-such-org/no-such-dataset'" in message and "HF_HUB_OFFLINE" in message
    assert "no local folder" in message  # it could also have been meant as a relative path


def test_a_hub_id_that_does_not_exist(monkeypatch):
    def not_found(*args, **kwargs):  # what datasets raises when the Hub answers 404
        message = "Dataset 'org/nope' doesn't exist on the Hub or cannot be accessed."
        raise datasets.exceptions.DatasetNotFoundError(message)

    monkeypatch.setattr(files, "load_dataset", not_found)
    with pytest.raises(DataError, match=r"doesn't exist on the Hub.*hf auth login"):
        load_raw_dataset("org/nope")


def test_a_folder_without_data_files(tmp_path):
    (tmp_path / "notes.md").write_text("nothing to train on\n")
    with pytest.raises(DataError, match="no data files"):
        load_raw_dataset(str(tmp_path))


def write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD_LINE = json.dumps(GOOD)


@pytest.mark.parametrize("bad_line", ['{"messages": [', "hello, not json"])
def test_a_jsonl_file_with_one_corrupt_line(tmp_path, bad_line):
    path = write_lines(tmp_path / "train.jsonl", [GOOD_LINE] * 5 + [bad_line] + [GOOD_LINE] * 3)
    with pytest.raises(DataError, match=r"line 6 is not valid JSON") as raised:
        load_raw_dataset(str(path))
    assert str(path) in str(raised.value)


def test_a_corrupt_file_in_a_folder_is_named(tmp_path):
    write_lines(tmp_path / "train.jsonl", [GOOD_LINE] * 4)
    bad = write_lines(tmp_path / "test.jsonl", [GOOD_LINE, '{"messages": [{"role": "user"'])
    with pytest.raises(DataError, match=r"line 2 is not valid JSON") as raised:
        load_raw_dataset(str(tmp_path))
    assert str(bad) in str(raised.value) and "train.jsonl" not in str(raised.value)


def test_files_of_one_split_with_different_columns(tmp_path):
    write_lines(tmp_path / "train-0.jsonl", [GOOD_LINE])
    write_lines(tmp_path / "train-1.jsonl", [json.dumps({"prompt": "a", "completion": "b"})])
    with pytest.raises(DataError, match=r"do not all have the same columns: some have \['messages'\], others"):
        load_raw_dataset(str(tmp_path))


def test_a_json_line_that_is_not_an_object(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [GOOD_LINE, "[1, 2]"])
    with pytest.raises(DataError, match=r"line 2 is an array, not an object"):
        load_raw_dataset(str(path))


def test_a_corrupt_json_document(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"messages": []},\n  {"messages" []}\n]\n')
    with pytest.raises(DataError, match=r"not valid JSON: .* line 3, column 15") as raised:
        load_raw_dataset(str(path))
    assert str(path) in str(raised.value)


def test_a_corrupt_parquet_file(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file") as raised:
        load_raw_dataset(str(path))
    assert str(path) in str(raised.value)


def test_a_corrupt_csv_file(tmp_path):
    path = write_lines(tmp_path / "train.csv", ["prompt,completion", "a,b", "c,d,e,f"])
    with pytest.raises(DataError, match=r"not a readable CSV file.*line 3") as raised:
        load_raw_dataset(str(path))
    assert str(path) in str(raised.value)


def test_good_files_still_load(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [GOOD] * 3)
    write_jsonl(tmp_path / "test.jsonl", [GOOD])
    raw = load_raw_dataset(str(tmp_path))
    assert len(raw["train"]) == 3 and len(raw["test"]) == 1


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], "starts with an assistant turn"),
        ([{"role": "system", "content": "be brief"}] + TURNS[1:], "starts with an assistant turn"),
        ([TURNS[0]], "has no assistant turn"),
        ([], "is empty"),
        ([TURNS[0], {"content": "cba"}], "turn 1 has no role"),
        ([TURNS[0], {"role": "assistant"}], "turn 1 (assistant) has no content"),
        ([{"role": "human", "content": "x"}, TURNS[1]], "turn 0 has role 'human'"),
    ],
)
def test_a_bad_conversation_is_named_by_its_index(tokenizer, messages, problem):
    data = Dataset.from_list([GOOD] * 17 + [{"messages": messages}] + [GOOD] * 2)
    with pytest.raises(DataError, match="example 17 of the train split: ") as raised:
        tokenize_dataset(data, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=64)
    assert problem in str(raised.value)


def test_messages_that_are_not_a_list_of_turns(tmp_path, tokenizer):
    # datasets reads a column whose JSON type changes from line to line (as Json), so this is found per example.
    path = write_lines(tmp_path / "train.jsonl", [GOOD_LINE] * 3 + [json.dumps({"messages": "just text"})])
    train = load_raw_dataset(str(path))["train"]
    with pytest.raises(DataError, match="example 3 of the train split: 'messages' is a string, not a list of turns"):
        tokenize_dataset(train, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=64)


def test_a_tool_call_with_arguments_that_are_not_json_is_named_by_its_example_and_turn(tmp_path):
    """OpenAI-style rows (each call's arguments as JSON text) read from a file as datasets reads them: the broken call
    is refused, not trained (tests/test_real_chat_templates.py has the other uncallable calls)."""
    from helpers.real_templates import family_tokenizer

    def row(arguments: str) -> dict:
        call = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": arguments}}
        return {"messages": [TURNS[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                             {"role": "assistant", "content": "It is sunny."}]}  # fmt: skip

    path = write_jsonl(tmp_path / "train.jsonl", [row('{"city": "Oslo"}')] * 3 + [row('{"city": "Paris"')])
    train = load_raw_dataset(str(path))["train"]
    expected = r"example 3 of the train split: turn 1 \(assistant\): the arguments of its call of 'get_weather' are not"
    with pytest.raises(DataError, match=expected):
        tokenize_dataset(train, family_tokenizer("qwen3"), assistant_only_loss=True, completion_only_loss=True,
                         max_length=4096)  # fmt: skip


def test_a_conversational_completion_without_an_assistant_turn(tokenizer):
    good = {"prompt": TURNS[:1], "completion": TURNS[1:]}
    data = Dataset.from_list([good, {"prompt": TURNS[:1], "completion": [{"role": "user", "content": "?"}]}])
    with pytest.raises(DataError, match="example 1 of the eval split: .*has no assistant turn"):
        tokenize_dataset(
            data, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=64, name="eval"
        )


def test_a_template_that_refuses_a_conversation_is_reported_as_data(tokenizer):
    strict = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    data = Dataset.from_list([GOOD, {"messages": TURNS + [TURNS[1]]}])
    with pytest.raises(DataError, match="example 1 of the train split: the chat template refused it: .*alternate"):
        tokenize_dataset(data, strict, assistant_only_loss=True, completion_only_loss=True, max_length=64)


def test_the_tokenizer_message_the_step_recognises_is_the_installed_ones(tokenizer):
    """transformers says "not text" with a plain ValueError: the step reads its message, so the message is pinned here
    against the installed transformers (an upgrade that rewords it fails this test, not a user's run)."""
    from fsdp_recipes.common import steps

    with pytest.raises(ValueError) as raised:
        tokenizer([TURNS])  # chat turns where text was expected
    assert str(raised.value).startswith(steps.TOKENIZER_NON_TEXT)


def test_library_errors_are_recognised_by_their_classes():
    """huggingface_hub's own exception classes and its HTTP client's transport errors, as the installed versions
    define them, each become the step's message."""
    import importlib

    from huggingface_hub import errors

    from fsdp_recipes.common import steps

    current = steps.Step("loading the model from 'org/name'", name="org/name", setting="model_name_or_path")
    client = importlib.import_module(errors.HTTPError.__module__.split(".")[0])

    def response(status):
        return client.Response(status, request=client.Request("GET", "https://huggingface.co/api/models/org/name"))

    cases = {
        errors.GatedRepoError("403 gated", response=response(403)): "gated",
        errors.RepositoryNotFoundError("404", response=response(404)): "no such repository",
        errors.RevisionNotFoundError("404 revision", response=response(404)): "no such revision",
        errors.HFValidationError("bad id"): "cannot be a Hub id",
        client.ConnectError("connection refused"): "could not be reached",
    }
    for error, expected in cases.items():
        translated = steps.user_error_from(error, current)
        assert translated is not None and expected in str(translated), (type(error).__name__, translated)
    assert steps.user_error_from(RuntimeError("a bug"), current) is None
