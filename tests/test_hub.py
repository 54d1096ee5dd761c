"""Pushing to the Hub, against a stand-in for the Hub API that records what would be sent."""

from __future__ import annotations

import pytest

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.publish.hub import push_folder_to_hub, require_hub_token


class RecordingHubApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations, kwargs))

        class Commit:
            commit_url = f"https://hub.example/{repo_id}/commit/1"

        return Commit()


def test_push_uploads_the_model_folder_and_nothing_else(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "metrics.jsonl"):
        (tmp_path / name).write_text(name)
    (tmp_path / "checkpoints" / "step-10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-10" / "optimizer.bin").write_text("big")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("")
    api = RecordingHubApi()
    url = push_folder_to_hub(tmp_path, "me/tiny", token="hf_secret", private=True, api=api)
    assert url.endswith("/commit/1")
    (create, repo, options), (commit, repo2, operations, commit_options) = api.calls
    assert create == "create_repo" and repo == "me/tiny" and options["private"] is True
    assert options["exist_ok"] is True and options["token"] == "hf_secret"
    assert commit == "create_commit" and repo2 == "me/tiny"
    uploaded = sorted(op.path_in_repo for op in operations)
    assert uploaded == ["README.md", "config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json"]


def test_missing_token_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no Hugging Face token"):
        require_hub_token()
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    assert require_hub_token() == "hf_abc"
