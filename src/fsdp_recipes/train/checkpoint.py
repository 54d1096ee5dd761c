"""Resumable checkpoints: written completely or not at all, found through `latest`, pruned to the last K.

Layout under `output_dir/checkpoints/`:

    step-00000200/             a complete checkpoint (never modified once it has this name)
        pytorch_model_fsdp_0/  model: DCP shards, one file per rank (SHARDED_STATE_DICT) ...
                               (LoRA: the adapters only; the frozen base is read again from model_name_or_path)
        optimizer_0/           ... or pytorch_model_fsdp.bin / optimizer.bin written by rank 0 (FULL_STATE_DICT)
        random_states_<rank>.pkl, custom_checkpoint_0.pkl (LR scheduler)   (accelerate's save_state)
        data_state_<rank>.json the data position of each rank, for data read as per-rank streams (pretraining);
                               absent when the position is progress.json's (map-style data, any world size)
        progress.json          step, data position, world size: written last, before the rename
        model/                 config, generation config, tokenizer: what an offline export needs
    latest                     text file naming the newest complete checkpoint
    .staging-step-00000300/    a save in progress (or killed midway): ignored, removed by the next save

A checkpoint becomes visible only by an atomic rename of its staging folder after every rank has written its part,
and `latest` is replaced atomically after that, so a crash at any point leaves the previous checkpoint as `latest`.
Multi-node training needs `output_dir` on a filesystem shared by all nodes (every rank writes its own shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.faults import inject_fault
from fsdp_recipes.distributed import logs
from fsdp_recipes.models.adapters import checkpoint_state_filter
from fsdp_recipes.train.cadence import Cadence
from fsdp_recipes.train.disk_full import disk_full_error

CHECKPOINTS = "checkpoints"
LATEST = "latest"
PROGRESS = "progress.json"
MODEL_FILES = "model"
RUN_INFO = "run.json"  # in MODEL_FILES: the recipe and task that wrote the checkpoint
_PREFIX = "step-"
_STAGING = ".staging-"


@dataclasses.dataclass
class TrainingProgress:
    """Where training stands after `step` optimizer steps; the data position is that of the next batch."""

    step: int
    epoch: int
    batches_into_epoch: int  # per-rank batches of `epoch` already consumed
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    # True: each rank kept its own data position (data_state_<rank>.json) and epoch / batches_into_epoch are rank 0's;
    # such a position belongs to one split of the data into ranks, so only the same world size can continue it
    data_state_per_rank: bool = False

    @property
    def rows_into_epoch(self) -> int:
        """Rows of the epoch already consumed by all ranks together: what survives a change of world size."""
        return self.batches_into_epoch * self.per_device_train_batch_size * self.world_size

    def check_resumable(
        self, *, world_size: int, per_device_train_batch_size: int, gradient_accumulation_steps: int
    ) -> None:
        """ConfigError unless this launch continues the same training: the same global batch (so the same schedule
        and a data position it can reproduce), whatever its split into processes unless the position is per rank."""
        if self.data_state_per_rank and (world_size, per_device_train_batch_size) != (
            self.world_size,
            self.per_device_train_batch_size,
        ):
            raise ConfigError(
                f"the checkpoint was written by {self.world_size} processes x {self.per_device_train_batch_size} rows, "
                f"each process keeping its own position in its own part of the data; {world_size} processes x "
                f"{per_device_train_batch_size} rows would split the data differently, so the run could not continue "
                "where it stopped. Resume with --num_processes "
                f"{self.world_size} and --per_device_train_batch_size {self.per_device_train_batch_size}."
            )
        if gradient_accumulation_steps != self.gradient_accumulation_steps:
            raise ConfigError(
                f"the checkpoint was written with gradient_accumulation_steps={self.gradient_accumulation_steps}, this "
                f"run has {gradient_accumulation_steps}: the global batch, and with it the schedule and the data "
                f"position, would change. Resume with --gradient_accumulation_steps {self.gradient_accumulation_steps}."
            )
        self.batches_into_epoch_for(world_size, per_device_train_batch_size)

    def batches_into_epoch_for(self, world_size: int, per_device_train_batch_size: int) -> int:
        rows_per_batch = world_size * per_device_train_batch_size
        if self.rows_into_epoch % rows_per_batch:
            raise ConfigError(
                f"the checkpoint stopped {self.rows_into_epoch} rows into epoch {self.epoch}, which is not a whole "
                f"number of batches of {world_size} processes x {per_device_train_batch_size} rows. Resume with "
                "per_device_train_batch_size x processes equal to the original "
                f"({self.per_device_train_batch_size} x {self.world_size}), so the global batch is unchanged."
            )
        return self.rows_into_epoch // rows_per_batch


class Checkpointer:
    """Saves a checkpoint every `every` optimizer steps and at the last one (None: never), with the data position
    that `position()` gives at that moment, and each rank's own `rank_state()` if given. Save time is left out of the
    throughput figures (`pause`)."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str | Path,
        *,
        every: int | None,
        total_steps: int,
        save_total_limit: int | None,
        position,
        model_files_writer=None,
        pause=contextlib.nullcontext,
        rank_state=None,
        extra_files: dict[str, str] | None = None,
        after_save=None,
    ):
        """`after_save(step)`: called on every rank after each save (e.g. a Hub push), inside the pause."""
        self.accelerator, self.output_dir, self.after_save = accelerator, output_dir, after_save
        self.cadence = Cadence(every, total_steps, at_last_step=every is not None)
        self.save_total_limit, self.position, self.model_files_writer = save_total_limit, position, model_files_writer
        self.pause, self.rank_state, self.extra_files = pause, rank_state, extra_files
        self.saved: Path | None = None  # the last checkpoint this run wrote

    def maybe_save(self, step: int) -> Path | None:
        return self.save(step) if self.cadence.due(step) else None

    def save(self, step: int) -> Path:
        """Collective: the checkpoint of step `step` (a preemption saves outside the cadence)."""
        if self.saved is not None and self.saved.name == checkpoint_name(step):
            return self.saved
        with self.pause():
            saved = save_checkpoint(
                self.accelerator,
                self.output_dir,
                self.position(step),
                save_total_limit=self.save_total_limit,
                model_files_writer=self.model_files_writer,
                rank_state=self.rank_state() if self.rank_state else None,
                extra_files=self.extra_files,
            )
            if self.after_save is not None:
                self.after_save(step)
            self.saved = saved
            return saved


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / PROGRESS).is_file()]
    return sorted(found, key=lambda p: p.name)


@torch.no_grad()
def complete_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every trained parameter that has had no gradient yet (a vision tower's layers past the one the model
    reads, experts no token reached) the state AdamW would create at its first gradient: zero moments, step 0. A
    checkpoint then holds a state for every parameter, which torch's distributed loading expects (it fills a fresh
    optimizer's state for all of them before reading); the updates that follow are those of the run without it."""
    held = {p: p.grad for group in optimizer.param_groups for p in group["params"]}  # restored after
    missing = {p for p in held if p.requires_grad and p not in optimizer.state}  # (by identity)
    if not missing:
        return
    for parameter in held:  # AdamW steps only the parameters with a gradient: the missing ones, at rate 0
        parameter.grad = torch.zeros_like(parameter) if parameter in missing else None
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for parameter, grad in held.items():
            parameter.grad = grad
        for parameter in missing:
            optimizer.state[parameter]["step"].zero_()  # as it was before its first gradient


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    progress: TrainingProgress,
    *,
    save_total_limit: int | None,
    model_files_writer=None,
    rank_state: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Collective. `model_files_writer(folder)`, if given, is called on the main process to add what an offline
    export needs (config, tokenizer). `rank_state`, if given, is this rank's data position (JSON), written by each
    rank into the checkpoint before it is committed. `extra_files`: {name: text} the recipe keeps with every
    checkpoint (e.g. precomputed reference values), written by the main process, committed with the rest."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / checkpoint_name(progress.step)
    staging = root / f"{_STAGING}{checkpoint_name(progress.step)}"
    if accelerator.is_main_process:
        for leftover in root.glob(f"{_STAGING}*"):  # saves killed midway
            shutil.rmtree(leftover)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        models = [accelerator.unwrap_model(model) for model in getattr(accelerator, "_models", [])]
        for optimizer in getattr(accelerator, "_optimizers", []):
            complete_optimizer_state(getattr(optimizer, "optimizer", optimizer))
        with checkpoint_state_filter(accelerator), logs.tied_copies_unannounced(models):  # LoRA: adapters only
            accelerator.save_state(str(staging))
        if rank_state is not None:
            _write_atomically(rank_state_path(staging, accelerator.process_index), json.dumps(rank_state) + "\n")
        inject_fault("during-save", progress.step, accelerator.process_index)
        accelerator.wait_for_everyone()  # every rank's shard is on disk
        if accelerator.is_main_process:
            if model_files_writer is not None:
                model_files_writer(staging / MODEL_FILES)
            for name, text in (extra_files or {}).items():
                _write_atomically(staging / name, text)
            record = dataclasses.asdict(progress)
            if not progress.data_state_per_rank:  # progress.json as before the field existed, for older readers
                del record["data_state_per_rank"]
            _write_atomically(staging / PROGRESS, json.dumps(record, indent=2) + "\n")
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        root = Path(output_dir) / CHECKPOINTS
        disk_full = disk_full_error(
            accelerator,
            error,
            root=root,
            staging=staging,
            previous=latest_checkpoint(output_dir),
            step_name=staging.name.removeprefix(_STAGING),
        )
        if disk_full is None:
            raise
        # DCP (SHARDED_STATE_DICT) gathers every rank's write errors, so then all ranks raise this together. A failed
        # torch.save (FULL_STATE_DICT weights, RNG states) fails only on the ranks that wrote: the others wait in
        # the next collective until the launcher, seeing this rank exit, stops them.
        raise disk_full from error
    if accelerator.is_main_process:
        replaced = root / f"{_STAGING}replaced-{final.name}"
        if final.exists():  # a step saved before (checkpoint_conflict refuses the usual ways to get here)
            os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
        _write_atomically(root / LATEST, final.name + "\n")
        prune_checkpoints(output_dir, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def write_model_files(
    folder: Path,
    *,
    model_config,
    generation_config,
    tokenizer,
    recipe_config: dict,
    accelerate_config: dict,
    run_info: dict,
) -> None:
    """What an offline export needs besides the weights: the model folder minus weights, and the model card inputs."""
    folder.mkdir(parents=True, exist_ok=True)
    model_config.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "recipe_config.json").write_text(json.dumps(recipe_config, indent=2, default=str) + "\n")
    (folder / "accelerate_config.json").write_text(json.dumps(accelerate_config, indent=2, default=str) + "\n")
    (folder / RUN_INFO).write_text(json.dumps(run_info, indent=2) + "\n")


def prune_checkpoints(output_dir: str | Path, save_total_limit: int | None) -> list[Path]:
    """Deletes all but the newest `save_total_limit` complete checkpoints; never the one `latest` names."""
    if not save_total_limit:
        return []
    checkpoints = complete_checkpoints(output_dir)
    latest = latest_checkpoint(output_dir)
    doomed = [p for p in checkpoints[: max(0, len(checkpoints) - save_total_limit)] if p != latest]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def checkpoint_conflict(output_dir: str | Path, resume_from: Path | None) -> str | None:
    """Why this run's checkpoints would mix with an earlier run's in output_dir, or None. Pruning and `latest` go by
    step number, so a new run (or one resumed from an older step) would have its checkpoints mistaken for, or
    deleted in favour of, the earlier run's."""
    existing = complete_checkpoints(output_dir)
    if not existing:
        return None
    names = ", ".join(p.name for p in existing[-3:])
    resuming_here = resume_from is not None and resume_from.resolve() in [p.resolve() for p in existing]
    if not resuming_here:
        return (
            f"output_dir {str(output_dir)!r} holds checkpoints of an earlier run ({names}). Resume it with "
            "--resume_from_checkpoint latest, or choose a new output_dir."
        )
    newer = [p.name for p in existing if p.name > resume_from.name]
    if newer:
        return (
            f"resuming from {resume_from.name}, but newer checkpoints exist ({', '.join(newer)}) that this run would "
            "overwrite step by step. Resume from latest, or move the newer ones out of output_dir/checkpoints first."
        )
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    pointer = Path(output_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / PROGRESS).is_file() else None


def resolve_checkpoint(output_dir: str | Path, resume_from_checkpoint: str) -> Path:
    """`latest` or a path -> a complete checkpoint folder, or ConfigError saying why not."""
    if resume_from_checkpoint == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise ConfigError(
                f"resume_from_checkpoint is 'latest' but {Path(output_dir) / CHECKPOINTS} holds no complete "
                "checkpoint. Start without --resume_from_checkpoint, or point it at a checkpoint folder."
            )
        return path
    path = Path(resume_from_checkpoint)
    if not (path / PROGRESS).is_file():
        raise ConfigError(
            f"{resume_from_checkpoint!r} is not a complete checkpoint (no {PROGRESS}): it may have been killed while "
            "saving. Use --resume_from_checkpoint latest, or one of the step-* folders under output_dir/checkpoints."
        )
    return path


def saved_model_config_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / MODEL_FILES / "config.json"


def saved_recipe_config_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / MODEL_FILES / "recipe_config.json"


def read_progress(checkpoint: str | Path) -> TrainingProgress:
    return TrainingProgress(**json.loads((Path(checkpoint) / PROGRESS).read_text()))


def rank_state_path(checkpoint: str | Path, rank: int) -> Path:
    return Path(checkpoint) / f"data_state_{rank}.json"


def read_rank_state(checkpoint: str | Path, rank: int) -> dict:
    """This rank's data position as `save_checkpoint(rank_state=...)` wrote it, or ConfigError if there is none."""
    path = rank_state_path(checkpoint, rank)
    if not path.is_file():
        raise ConfigError(
            f"{checkpoint} holds no data position for rank {rank} ({path.name}): it was written by a run that read its "
            "data another way (another recipe, or map-style data) or by fewer processes. Resume it with the settings "
            "that wrote it, or start a new run in a new output_dir."
        )
    return json.loads(path.read_text())


def load_checkpoint(accelerator: Accelerator, checkpoint: str | Path) -> TrainingProgress:
    """Collective. Restores model and optimizer (resharded by DCP if the world size changed), LR scheduler and, for
    ranks that have one saved, their RNG state."""
    with checkpoint_state_filter(accelerator):
        accelerator.load_state(str(checkpoint))
    return read_progress(checkpoint)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def allow_config_change_problems(config) -> list[str]:
    """What is wrong with `allow_config_change`: set without resuming, or naming a field resuming does not check."""
    if config.allow_config_change is None:
        return []
    if not config.resume_from_checkpoint:
        return ["allow_config_change applies to a resumed run only: set resume_from_checkpoint, or remove it"]
    problems, sensitive = [], config.resume_sensitive_fields()
    for name in config.allow_config_change:
        if name in config.resume_fixed_fields():
            problems.append(
                f"allow_config_change: {name} cannot change on resume: the checkpoint's tensors "
                "depend on it. Start a new run in a new output_dir instead"
            )
        elif name not in sensitive:
            close = difflib.get_close_matches(name, sensitive, n=1)
            problems.append(
                f"allow_config_change: {name!r} is not a field that resuming checks"
                + (f"; did you mean {close[0]!r}?" if close else f" (those are: {', '.join(sensitive)})")
            )
    return problems


def check_resume_config(config, saved: dict[str, Any], checkpoint: Path) -> dict[str, list[Any]]:
    """Compares the fields the run depends on (the config class says which) with the values `checkpoint` was trained
    with (its saved recipe config; a field it lacks had its default). Raises ConfigError listing every change that is
    not allowed; returns the allowed ones, {field: [old, new]}, for the metrics log."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}

    def before(name):
        return saved.get(name, defaults.get(name))

    fixed = [
        f"{name} {before(name)!r} in the checkpoint, {getattr(config, name)!r} now"
        for name in config.resume_fixed_fields()
        if before(name) != getattr(config, name)
    ]
    if fixed:
        raise ConfigError(
            f"{checkpoint} was trained with other LoRA settings ({'; '.join(fixed)}): resume with the "
            "settings that wrote it, or start a new run in a new output_dir"
        )
    changed = {
        name: [before(name), getattr(config, name)]
        for name in config.resume_sensitive_fields()
        if before(name) != getattr(config, name)
    }
    refused = [name for name in changed if name not in (config.allow_config_change or [])]
    if refused:
        listed = "; ".join(f"{name}: {changed[name][0]!r} -> {changed[name][1]!r}" for name in refused)
        raise ConfigError(
            f"{checkpoint} was trained with other settings that change the objective or the data ({listed}), so the "
            "resumed run would mix two trainings. Resume with the values it was trained with (model/recipe_config.json "
            "in the checkpoint), start a new run in a new output_dir, or allow the change explicitly: "
            f"--allow_config_change {' '.join(refused)} (recorded in metrics.jsonl)"
        )
    return changed
