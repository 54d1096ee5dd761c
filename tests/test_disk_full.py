"""A disk that fills during a checkpoint save: one DiskFullError saying so (where, how much is free, how much a
checkpoint needs, the fix), the partial save removed, and `latest` still naming the previous checkpoint, which
resumes. In-process, one CPU process; the writes fail on /dev/full, so the errors are the ones torch really raises."""

from __future__ import annotations

import errno
import os
import shutil
import stat

import pytest
import torch

from fsdp_recipes.common.errors import ConfigError, DiskFullError, UserError, exit_on_user_error
from fsdp_recipes.train.checkpoint import (
    CHECKPOINTS,
    TrainingProgress,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_recipes.train.disk_full import disk_full_cause

FULL = "/dev/full"  # every write fails with ENOSPC; opened in place, never replaced (no rename, no unlink)
REAL_SAVE = torch.save

pytestmark = pytest.mark.skipif(
    not (os.path.exists(FULL) and stat.S_ISCHR(os.stat(FULL).st_mode)), reason="needs the /dev/full device"
)


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)


def progress(step: int) -> TrainingProgress:
    return TrainingProgress(
        step=step,
        epoch=0,
        batches_into_epoch=step,
        world_size=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
    )


def fail_staged_torch_saves(monkeypatch, write_to_full):
    """torch.save calls that target a staging folder write to /dev/full instead (the model, written by
    safetensors, lands on disk first, so the save fails midway, as on a real disk)."""

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and ".staging-" in str(f):
            return write_to_full(obj, *args, **kwargs)
        return REAL_SAVE(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def torch_writer_on_full_disk(obj, *args, **kwargs):
    REAL_SAVE(obj, FULL, *args, **kwargs)  # torch's C++ zip writer: a RuntimeError that carries no errno


def file_object_on_full_disk(obj, *args, **kwargs):
    with open(FULL, "wb") as handle:
        REAL_SAVE(obj, handle, *args, **kwargs)  # Python file writes: OSError(ENOSPC) in the chain


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_what_to_do(tmp_path, accelerator, monkeypatch):
    previous = save_checkpoint(accelerator, tmp_path, progress(1), save_total_limit=None)
    fail_staged_torch_saves(monkeypatch, file_object_on_full_disk)
    with pytest.raises(DiskFullError) as raised:
        save_checkpoint(accelerator, tmp_path, progress(2), save_total_limit=None)
    error = raised.value
    assert isinstance(error, UserError) and isinstance(error, OSError)
    message = str(error)
    assert "disk is full" in message and str(tmp_path / CHECKPOINTS) in message
    assert "free there now" in message and "the previous checkpoint, step-00000001, takes" in message
    assert "save_total_limit" in message and "output_dir" in message
    assert "step-00000001 is still the latest complete checkpoint: --resume_from_checkpoint latest" in message
    root = tmp_path / CHECKPOINTS
    assert latest_checkpoint(tmp_path) == previous
    assert not list(root.glob(".staging-*")) and not (root / "step-00000002").exists()
    monkeypatch.setattr(torch, "save", REAL_SAVE)
    assert load_checkpoint(accelerator, latest_checkpoint(tmp_path)).step == 1


def test_torchs_own_writer_failing_on_a_full_disk(tmp_path, accelerator, monkeypatch):
    fail_staged_torch_saves(monkeypatch, torch_writer_on_full_disk)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=0))  # what a full disk shows
    with pytest.raises(DiskFullError) as raised:
        save_checkpoint(accelerator, tmp_path, progress(1), save_total_limit=None)
    # No earlier checkpoint: the need is estimated from the parameters (fp32 weights + AdamW's two moments).
    assert "0 bytes free there now" in str(raised.value) and "272 parameters" in str(raised.value)
    assert latest_checkpoint(tmp_path) is None and not list((tmp_path / CHECKPOINTS).glob(".staging-*"))


def test_a_write_failure_with_room_on_the_disk_is_not_called_a_full_disk(tmp_path, accelerator, monkeypatch):
    fail_staged_torch_saves(monkeypatch, torch_writer_on_full_disk)
    with pytest.raises(RuntimeError) as raised:
        save_checkpoint(accelerator, tmp_path, progress(1), save_total_limit=None)
    assert not isinstance(raised.value, DiskFullError)


def test_a_sharded_save_on_a_full_disk_is_recognised(tmp_path, monkeypatch):
    """DCP (SHARDED_STATE_DICT) gathers every rank's write error into a CheckpointException, a BaseException that
    holds the OSError rather than chaining it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_create_stream = FileSystem.create_stream

    def create_stream(self, path, mode):
        return real_create_stream(self, FULL if str(path).endswith(".distcp") else path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    with pytest.warns(UserWarning, match="single process"), pytest.raises(CheckpointException) as raised:
        dcp.save({"model": {"weight": torch.zeros(64)}}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    cause = disk_full_cause(raised.value)
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert disk_full_cause(RuntimeError("unrelated")) is None


def test_a_rank_that_alone_ran_out_of_space_says_so(monkeypatch, capsys):
    """Errors every rank meets are printed by rank 0 only; a full disk met by rank 1 alone is printed by rank 1."""
    monkeypatch.setenv("RANK", "1")

    def fail(error):
        def main():
            raise error

        with pytest.raises(SystemExit) as exited:
            exit_on_user_error(main)
        assert exited.value.code == 2
        return capsys.readouterr().err

    assert fail(ConfigError("every rank sees this")) == ""
    assert fail(DiskFullError("the disk is full: ...", reported_by_main_rank=False)) == (
        "error: rank 1: the disk is full: ...\n"
    )
