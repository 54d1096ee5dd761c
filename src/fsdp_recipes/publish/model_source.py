"""What an evaluation loads: a model folder, a Hub id, or a recipe checkpoint (`output_dir/checkpoints/step-N`),
which holds sharded weights and is exported to a temporary model folder first (`fsdp_recipes.publish.checkpoint_export`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import gather_object

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.steps import looks_like_hub_id
from fsdp_recipes.distributed.collectives import on_every_rank_together
from fsdp_recipes.publish.checkpoint_export import export_checkpoint
from fsdp_recipes.train.checkpoint import MODEL_FILES, PROGRESS, RUN_INFO


@dataclasses.dataclass
class ModelSource:
    name: str  # as the user gave it
    kind: str  # "folder", "adapter" (a peft LoRA folder), "checkpoint" or "hub"
    files: str  # where the tokenizer (and, but for adapters, the config) is read: the folder, the checkpoint's model
    # files, or the Hub id
    base: str | None = None  # LoRA (an adapter folder or a LoRA run's checkpoint): the base model the adapter is for

    @property
    def config_files(self) -> str:
        """Where the model config is read: an adapter folder has none of its own (its base's applies)."""
        return self.base if self.kind == "adapter" else self.files

    @property
    def local_folder(self) -> Path | None:
        return Path(self.name) if self.kind in ("folder", "adapter") else None


def resolve(name: str, *, base_model_name_or_path: str | None = None) -> ModelSource:
    """ConfigError if `name` is a local path that is neither a model folder nor a recipe checkpoint, or a LoRA adapter
    (folder or checkpoint) whose base model is a local path that does not exist here. `base_model_name_or_path`: the
    base to merge a LoRA adapter into instead of the one it records."""
    path = Path(name)
    source = _resolve(name, path)
    if base_model_name_or_path is not None:
        if source.base is None:
            raise ConfigError(
                f"base_model_name_or_path is for LoRA adapters, and {name!r} is not one ({source.kind}): remove it"
            )
        return dataclasses.replace(source, base=base_model_name_or_path)
    if source.base is not None and not looks_like_hub_id(source.base) and not Path(source.base).expanduser().exists():
        recorded = (
            "its adapter_config.json's base_model_name_or_path"
            if source.kind == "adapter"
            else "the model_name_or_path of the run that wrote it"
        )
        raise ConfigError(
            f"{name!r} is a LoRA adapter for the base model {source.base!r} ({recorded}), which does not exist here "
            f"({Path(source.base).expanduser().absolute()}). Set --base_model_name_or_path to that base model's folder "
            "or Hub id (the model the adapter was trained on)"
        )
    return source


def _resolve(name: str, path: Path) -> ModelSource:
    if not path.exists():
        return ModelSource(name=name, kind="hub", files=name)
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(
                f"{name!r} is a LoRA adapter folder whose adapter_config.json names no "
                "base_model_name_or_path: set --base_model_name_or_path to the base model's folder or "
                "Hub id"
            )
        return ModelSource(name=name, kind="adapter", files=name, base=base)
    if (path / "config.json").is_file():
        return ModelSource(name=name, kind="folder", files=name)
    if (path / MODEL_FILES / "config.json").is_file() and (path / PROGRESS).is_file():
        recipe_config = path / MODEL_FILES / "recipe_config.json"
        settings = json.loads(recipe_config.read_text()) if recipe_config.is_file() else {}
        base = settings.get("model_name_or_path") if settings.get("use_peft") else None
        return ModelSource(name=name, kind="checkpoint", files=str(path / MODEL_FILES), base=base)
    hint = ""
    if (path / "checkpoints" / "latest").is_file():
        latest = (path / "checkpoints" / "latest").read_text().strip()
        hint = f" It looks like a recipe output_dir whose training did not finish: evaluate {path / 'checkpoints' / latest}."
    raise ConfigError(
        f"{name!r} is neither a model folder (no config.json) nor a complete recipe checkpoint (progress.json and "
        f"{MODEL_FILES}/config.json).{hint}"
    )


def task_of(source: ModelSource, model_config) -> str:
    """sequence-classification for a classifier (its architecture, or the task its checkpoint records), else
    causal-lm."""
    if source.kind == "adapter":
        task_type = json.loads((Path(source.name) / "adapter_config.json").read_text()).get("task_type")
        if task_type == "SEQ_CLS":
            raise ConfigError(
                f"{source.name} is a classifier's LoRA adapter: its labels are not in its base's config. "
                "Evaluate the merged model (export_merged_model: true writes it to <output_dir>/merged) "
                "or the run's checkpoint"
            )
        return "causal-lm"
    if source.kind == "checkpoint":
        run_info = Path(source.files) / RUN_INFO
        if run_info.is_file():
            return json.loads(run_info.read_text()).get("task", "causal-lm")
    architectures = getattr(model_config, "architectures", None) or []
    return (
        "sequence-classification"
        if any(a.endswith("ForSequenceClassification") for a in architectures)
        else "causal-lm"
    )


@contextlib.contextmanager
def weights_folder(accelerator: Accelerator, source: ModelSource):
    """Collective. Yields what to load weights from (for LoRA, the adapter folder: load `source.base` and merge it in,
    `adapters.merge_into`). A checkpoint is exported once per machine, by its first process, into a temporary folder
    (machines need not share /tmp), removed when the block ends: load the model inside it."""
    if source.kind != "checkpoint":
        yield source.name
        return

    def export_here() -> str | None:
        if not accelerator.is_local_main_process:
            return None
        folder = tempfile.mkdtemp(prefix="fsdp-recipes-eval-")
        try:
            export_checkpoint(source.name, folder, overwrite=True)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    mine = on_every_rank_together(accelerator, export_here)
    folders = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    folder = folders[accelerator.process_index - accelerator.local_process_index]  # torchrun numbers ranks by machine
    try:
        yield folder
    finally:
        accelerator.wait_for_everyone()
        if mine is not None:
            shutil.rmtree(mine, ignore_errors=True)
