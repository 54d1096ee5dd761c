"""Pushing an exported model folder to the Hugging Face Hub, from the main process only.

The token is looked up before training starts (so a missing one costs nothing) and never printed.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, get_token

from fsdp_recipes.common.errors import ConfigError

# Training by-products that do not belong in a model repo: resumable checkpoints are large and rank-specific.
EXCLUDED_DIRECTORIES = ("checkpoints",)


def require_hub_token() -> str:
    token = get_token()  # HF_TOKEN, then the file written by `hf auth login`
    if not token:
        raise ConfigError(
            "push_to_hub is on but no Hugging Face token was found. Set the HF_TOKEN environment variable or run "
            "`hf auth login` on every node, or drop --push_to_hub."
        )
    return token


def files_to_upload(folder: str | Path) -> list[str]:
    """Paths, relative to `folder`, of what a push uploads: the model folder and run records, no checkpoints and no
    hidden files."""
    folder = Path(folder)
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or relative.parts[0] in EXCLUDED_DIRECTORIES:
            continue
        if any(part.startswith(".") for part in relative.parts):
            continue
        files.append(relative.as_posix())
    return files


def push_folder_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str,
    private: bool = True,
    commit_message: str = "Upload model trained with FSDP Recipes",
    api: HfApi | None = None,
    files: list[str] | None = None,
) -> str:
    """Creates the repo if needed and uploads `files` (paths relative to `folder`; default `files_to_upload(folder)`)
    in one commit. Returns the commit URL."""
    api = api or HfApi()
    folder = Path(folder)
    api.create_repo(repo_id, token=token, private=private, exist_ok=True, repo_type="model")
    operations = [
        CommitOperationAdd(path_in_repo=relative, path_or_fileobj=str(folder / relative))
        for relative in (files if files is not None else files_to_upload(folder))
    ]
    commit = api.create_commit(
        repo_id, operations=operations, commit_message=commit_message, token=token, repo_type="model"
    )
    return getattr(commit, "commit_url", str(commit))
