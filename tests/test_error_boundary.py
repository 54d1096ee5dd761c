"""The error boundary (docs/errors.md): a library's exception caused by the user's input becomes one `error:` line
naming the step, the input and the fix, where the step is named (`fsdp_recipes.common.steps`); any other exception is a
bug, shown once with its traceback and a line saying so; a rank stopped by another rank's failure says so in one line.
In this process, offline: no launch (tests/test_all_ranks_stop.py shows the same on a real 2-process launch)."""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import BUG_NOTE, InputError, PeerRankFailed, exit_on_user_error
from fsdp_recipes.data import files
from fsdp_recipes.distributed.collectives import on_every_rank_together
from fsdp_recipes.models import modeling


@pytest.fixture
def offline(monkeypatch):
    """A Hub id fails at once instead of retrying a network this machine may not have."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_missing_local_model_path_is_not_a_hub_id_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as raised:
        modeling.load_tokenizer("outputs/demo_reverse/latest", setting="model_name_or_path")
    message = str(raised.value)
    assert message.startswith(
        "loading the tokenizer from 'outputs/demo_reverse/latest' (model_name_or_path): there "
        f"is no such local path ({tmp_path}/outputs/demo_reverse/latest)"
    )
    assert "point model_name_or_path at an existing folder or a Hub id" in message


def test_an_unreachable_hub_id_names_the_setting_and_the_way_out(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as raised:
        modeling.load_model_config("outputs/sft", None)
    message = str(raised.value)
    assert message.startswith(
        "loading the model config from 'outputs/sft' (model_name_or_path): it is not in the "
        "local Hugging Face cache, and HF_HUB_OFFLINE is set"
    )
    assert "no local folder 'outputs/sft' either" in message and "Unset HF_HUB_OFFLINE" in message


def test_a_folder_without_a_tokenizer_or_a_config(tmp_path):
    with pytest.raises(InputError, match="it holds no tokenizer files.*Set tokenizer_name_or_path to the tokenizer"):
        modeling.load_tokenizer(str(tmp_path), setting="model_name_or_path")
    with pytest.raises(InputError, match="it has no config.json naming a model_type"):
        modeling.load_model_config(str(tmp_path), None)
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(InputError, match=r"config.json is not valid JSON \(Expecting .,. delimiter at line 1"):
        modeling.load_model_config(str(tmp_path), None)


def test_a_binary_file_read_as_a_text_stream_names_the_file(tmp_path):
    (tmp_path / "a.txt").write_text("a story")
    (tmp_path / "b.txt").write_bytes(bytes(range(128, 256)) * 4)
    stream = files.load_raw_dataset(str(tmp_path), streaming=True)["train"]
    with pytest.raises(InputError) as raised, files.reading(str(tmp_path)):
        list(stream)
    assert str(raised.value) == (
        f"reading dataset_name '{tmp_path}': {tmp_path / 'b.txt'}: it is not UTF-8 text (byte "
        "0 is not valid UTF-8: a binary file?). Fix it, or move it out of the folder"
    )


def test_chat_turns_given_as_a_text_column(tokenizer):
    from datasets import Dataset

    turns = Dataset.from_list([{"conversation": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(
        Exception,
        match=r"column 'conversation' of the eval split holds chat turns.*point text_column "
        "at a column of strings",
    ):
        files.check_text_column_type(turns, "conversation", split="eval", setting="text_column")
    with pytest.raises(InputError) as raised, files.tokenizing("conversation", split="eval", setting="text_column"):
        tokenizer(turns["conversation"])  # what the check above keeps from happening, translated all the same
    assert str(raised.value).startswith(
        "tokenizing column 'conversation' of the eval split (text_column): its values are not text"
    )


def test_a_bug_passes_the_step_with_a_note_and_the_boundary_says_it_is_one(capsys):
    def main():
        with steps.step("reading something"):
            raise KeyError("no such key")  # not the input's fault: a bug

    with pytest.raises(KeyError) as raised:
        exit_on_user_error(main)
    assert raised.value.__notes__ == ["(while reading something)", BUG_NOTE]
    assert capsys.readouterr().err == ""  # the interpreter prints the traceback (with the notes), once


def test_a_rank_stopped_by_another_ranks_bug_prints_one_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")

    def main():
        raise PeerRankFailed("rank 0 failed with an unexpected error (a bug: its traceback is above)", bug=True)

    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(main)
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "rank 1: stopping because rank 0 failed with an unexpected error (a bug: its traceback is above)\n"
    )


class _OneProcess:
    num_processes, process_index = 1, 0


def test_the_step_every_rank_runs_translates_and_names_itself():
    def read():
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    with pytest.raises(InputError, match=r"^preparing the data: it is not UTF-8 text \(invalid start byte at byte 0"):
        on_every_rank_together(_OneProcess(), read, what="preparing the data")
    with pytest.raises(ZeroDivisionError):
        on_every_rank_together(_OneProcess(), lambda: 1 / 0, what="preparing the data")


def test_fsdp_recipes_commands_get_the_same_error_line(tmp_path, capsys):
    """The `fsdp-recipes` commands print `error:` for the project's errors (tools/cli.py): a translated one is one."""
    from fsdp_recipes.tools import cli
    from helpers.paths import FSDP_CPU_CONFIG

    status = cli.main(["validate-config", str(FSDP_CPU_CONFIG), "--model", str(tmp_path / "no" / "such" / "model")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "loading the model config from" in line and "there is no such local path" in line


def test_translations_read_the_cause_chain():
    try:
        try:
            json.loads("{")
        except json.JSONDecodeError as inner:
            raise OSError("It looks like the config file is not a valid JSON file.") from inner
    except OSError as error:
        problem = steps.recognise(error, steps.Step("reading x", setting="model_config"))
    assert problem.text.startswith("a JSON file in it is not valid JSON (Expecting property name")  # no file named
    assert steps.recognise(RuntimeError("shape mismatch"), steps.Step("x")) is None
