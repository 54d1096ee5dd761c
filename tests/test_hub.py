"""Pushing to the Hub, against a stand-in for the Hub API that keeps a repo's files in memory and applies
huggingface_hub's own pattern filter to `upload_folder`, as the real client does before uploading."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml
from huggingface_hub import EvalResult, ModelCard
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.publish import hub
from fsdp_recipes.publish.hub import add_results_to_hub_card, push_folder_to_hub, require_hub_token
from helpers.recipes import base_recipe_values, recipe_error_in_process, run_recipe_in_process

USERS_CARD = """---
license: apache-2.0
tags:
- chat
model-index:
- name: me/tiny
  results:
  - task:
      type: text-generation
    dataset:
      name: someone/bench
      type: someone/bench
    metrics:
    - type: accuracy
      value: 0.5
      name: Accuracy
---

# My model

Written by its owner: nothing here may change.
"""


class StandInHubApi:
    """Records every call; `files` is the repo's content, path -> bytes, after each commit."""

    def __init__(self, files: dict[str, bytes] | None = None):
        self.calls, self.files = [], dict(files or {})

    def create_repo(self, repo_id, **options):
        self.calls.append(("create_repo", repo_id, options))

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, run_as_future=False, **options):
        root = Path(folder_path)
        every = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()]
        sent = list(filter_repo_objects(every, ignore_patterns=ignore_patterns))
        self.files.update({name: (root / name).read_bytes() for name in sent})
        self.calls.append(("upload_folder", repo_id, sorted(sent), options))
        if run_as_future:
            future = Future()
            future.set_result(f"https://hub.example/{repo_id}/commit/{len(self.calls)}")
            return future
        return type("Commit", (), {"commit_url": f"https://hub.example/{repo_id}/commit/{len(self.calls)}"})()

    def hf_hub_download(self, repo_id, filename, *, local_dir, **options):
        if filename not in self.files:
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        (Path(local_dir) / filename).write_bytes(self.files[filename])
        return str(Path(local_dir) / filename)

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, create_pr=False, **options):
        self.calls.append(("upload_file", repo_id, path_in_repo, {"create_pr": create_pr, **options}))
        if not create_pr:
            self.files[path_in_repo] = path_or_fileobj
        return type("Commit", (), {"commit_url": "https://hub.example/c", "pr_url": "https://hub.example/pr/1"})()


def test_push_uploads_the_model_folder_without_checkpoints_or_hidden_files(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "metrics.jsonl"):
        (tmp_path / name).write_text(name)
    (tmp_path / "checkpoints" / "step-10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-10" / "optimizer.bin").write_text("big")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("")
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    (tmp_path / "runs" / "sft" / "events.out").write_text("tensorboard")
    (tmp_path / "runs" / "sft" / ".DS_Store").write_text("")
    api = StandInHubApi()
    url = push_folder_to_hub(tmp_path, "me/tiny", token="hf_secret", private=True, api=api)
    assert url.endswith("/commit/2")
    (create, repo, options), (upload, repo2, sent, upload_options) = api.calls
    assert create == "create_repo" and repo == "me/tiny" and options["private"] is True
    assert options["exist_ok"] is True and options["token"] == "hf_secret"
    assert upload == "upload_folder" and repo2 == "me/tiny" and upload_options["token"] == "hf_secret"
    assert sent == [
        "README.md",
        "config.json",
        "metrics.jsonl",
        "model.safetensors",
        "runs/sft/events.out",
        "tokenizer.json",
    ]
    assert isinstance(push_folder_to_hub(tmp_path, "me/tiny", token="t", api=api, run_as_future=True), Future)


def results(value: float) -> list[EvalResult]:
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type="local/reverse",
            dataset_name="reverse",
            metric_type="perplexity",
            metric_name="Perplexity",
            metric_value=value,
        )
    ]


def test_eval_results_are_added_to_the_cards_metadata_and_nothing_else(tmp_path):
    api = StandInHubApi({"README.md": USERS_CARD.encode()})
    add_results_to_hub_card("me/tiny", results(3.0), token="t", api=api)
    add_results_to_hub_card("me/tiny", results(2.5), token="t", api=api)  # the same metric again: replaced
    card = ModelCard(api.files["README.md"].decode())
    assert card.text == ModelCard(USERS_CARD).text  # the owner's text, unchanged
    assert card.data.license == "apache-2.0" and card.data.tags == ["chat"]
    scores = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert scores == {("someone/bench", "accuracy"): 0.5, ("local/reverse", "perplexity"): 2.5}
    assert [call[0] for call in api.calls] == ["upload_file", "upload_file"]  # never a folder over the card


def test_eval_results_as_a_pull_request_and_on_a_repo_without_a_card(tmp_path):
    api = StandInHubApi({"README.md": USERS_CARD.encode()})
    url = add_results_to_hub_card("me/tiny", results(3.0), token="t", api=api, create_pr=True)
    assert url.endswith("/pr/1") and api.calls[-1][3]["create_pr"] is True
    assert api.files["README.md"] == USERS_CARD.encode()  # main untouched until the PR is merged
    bare = StandInHubApi()
    add_results_to_hub_card("me/new", results(3.0), token="t", api=bare)
    assert ModelCard(bare.files["README.md"].decode()).data.eval_results[0].metric_value == 3.0


def test_missing_token_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no Hugging Face token"):
        require_hub_token()
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    assert require_hub_token() == "hf_abc"


@pytest.mark.parametrize(
    "strategy, message",
    [("sometimes", "hub_strategy 'sometimes' is not one of end, every_save"), ("checkpoint", "use every_save")],
)
def test_an_unknown_hub_strategy_is_one_error_before_loading(
    tmp_path, tiny_model_config, small_chat_data, capsys, strategy, message
):
    values = base_recipe_values(tiny_model_config, small_chat_data, tmp_path / "out", hub_strategy=strategy)
    assert message in recipe_error_in_process("sft", tmp_path, values, capsys)


def test_every_save_pushes_the_model_at_each_checkpoint_then_at_the_end(
    tmp_path, tiny_model_config, small_chat_data, monkeypatch
):
    api = StandInHubApi()
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    values = base_recipe_values(
        tiny_model_config,
        small_chat_data,
        tmp_path / "out",
        max_steps=4,
        save_steps=2,
        push_to_hub=True,
        hub_model_id="me/tiny",
        hub_strategy="every_save",
        hub_private_repo=False,
    )
    run_recipe_in_process("sft", tmp_path, "every_save", values)
    assert all(call[2]["private"] is False for call in api.calls if call[0] == "create_repo")
    uploads = [call for call in api.calls if call[0] == "upload_folder"]
    assert [call[3]["commit_message"] for call in uploads] == [
        "Training in progress, step 2",
        "Upload model trained with FSDP Recipes",
    ]
    for _, _, sent, _ in uploads:
        assert "model.safetensors" in sent and "README.md" in sent
        assert not any(name.startswith("checkpoints/") for name in sent)
    card = yaml.safe_load(api.files["README.md"].decode().split("---")[1])
    assert "fsdp-recipes" in card["tags"]
    assert json.loads(api.files["config.json"])["model_type"] == "llama"


def test_eval_push_updates_the_hub_cards_metadata_only(tmp_path, pretrained_tiny_model, small_chat_data, monkeypatch):
    """eval.py --push_to_hub: the results are merged into the repo's own card; its text and the rest stay."""
    api = StandInHubApi({"README.md": USERS_CARD.encode(), "config.json": b"{}"})
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    values = dict(
        model_name_or_path=str(pretrained_tiny_model),
        dataset_name=str(small_chat_data),
        output_dir=str(tmp_path / "out"),
        max_length=64,
        metrics=["perplexity"],
        push_to_hub=True,
        hub_model_id="me/tiny",
    )
    run_recipe_in_process("eval", tmp_path, "eval", values)
    assert [call[0] for call in api.calls] == ["upload_file"] and api.files["config.json"] == b"{}"
    card = ModelCard(api.files["README.md"].decode())
    assert card.text == ModelCard(USERS_CARD).text
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics["accuracy"] == 0.5 and metrics["perplexity"] > 1  # the owner's result kept, ours added
