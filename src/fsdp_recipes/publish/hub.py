"""Pushing to the Hugging Face Hub, from the main process only: a run's folder with `upload_folder` (at the end, or
also at every save: `hub_strategy`), and an evaluation's results merged into a model card's metadata.

The token is looked up before training starts (so a missing one costs nothing) and never printed.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import EntryNotFoundError

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.publish.model_index import merge_eval_results

# Training by-products that do not belong in a model repo: resumable checkpoints are large and rank-specific, and
# hidden files (caches, locks, editor files) at any depth are nobody's model.
IGNORE_PATTERNS = ["checkpoints/**", ".*", "**/.*"]


def require_hub_token() -> str:
    token = get_token()  # HF_TOKEN, then the file written by `hf auth login`
    if not token:
        raise ConfigError(
            "push_to_hub is on but no Hugging Face token was found. Set the HF_TOKEN environment variable or run "
            "`hf auth login` on every node, or drop --push_to_hub."
        )
    return token


def push_folder_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str,
    private: bool = True,
    commit_message: str = "Upload model trained with FSDP Recipes",
    api: HfApi | None = None,
    run_as_future: bool = False,
) -> str | Future:
    """Creates the repo if needed and uploads the folder in one commit (`upload_folder`), without checkpoints and
    hidden files. Returns the commit URL, or with `run_as_future` a Future of the commit, uploaded in the background
    while training goes on (`hub_strategy: every_save`)."""
    api = api or HfApi()
    api.create_repo(repo_id, token=token, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        ignore_patterns=IGNORE_PATTERNS,
        commit_message=commit_message,
        token=token,
        repo_type="model",
        run_as_future=run_as_future,
    )
    return commit if run_as_future else getattr(commit, "commit_url", str(commit))


def add_results_to_hub_card(
    repo_id: str,
    results: list[EvalResult],
    *,
    token: str,
    create_pr: bool = False,
    api: HfApi | None = None,
    commit_message: str = "Evaluation results from FSDP Recipes",
) -> str:
    """Merges `results` into the model-index of the repo's own card (as huggingface_hub's `metadata_update` does):
    the card's text and every other metadata key stay as they are; earlier results for the same task, dataset,
    split and metric are replaced. A repo without a card gets a short one. `create_pr`: as a pull request, for a
    repo one may not (or would rather not) commit to. Returns the commit (or pull request) URL."""
    api = api or HfApi()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            card = ModelCard.load(api.hf_hub_download(repo_id, "README.md", token=token, local_dir=scratch))
        except EntryNotFoundError:
            data = ModelCardData(library_name="transformers", tags=["fsdp-recipes"])
            card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {repo_id}\n")
    merge_eval_results(card, results, model_name=repo_id)
    commit = api.upload_file(
        path_or_fileobj=str(card).encode(),
        path_in_repo="README.md",
        repo_id=repo_id,
        token=token,
        repo_type="model",
        commit_message=commit_message,
        create_pr=create_pr,
    )
    return getattr(commit, "pr_url", None) or getattr(commit, "commit_url", str(commit))
