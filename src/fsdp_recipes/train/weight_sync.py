"""The policy's weights on the vLLM server a run generates with (`ServerWeights`): after each optimizer step that
changed them and before the next generation, gathered from the FSDP2 shards, written once by the main process to a
fresh folder (LoRA merged, in the server's dtype: `models.serving_weights`), loaded by the server in place, its prefix
cache emptied, the previous folder removed. Files, not NCCL: the transport that works on CPU and GPU alike, and
across machines that share a filesystem; vLLM's NCCL and CUDA-IPC weight transfer is the seam for GPU-only speed
(docs/vllm.md)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fsdp_recipes.models import serving_weights
from fsdp_recipes.train import preemption
from fsdp_recipes.train.checkpoint import latest_checkpoint
from fsdp_recipes.train.vllm_client import ServerError, VLLMServer

WEIGHTS_FOLDER = ".vllm_weights"  # under output_dir unless vllm_weights_dir says where


def weights_root(config, output_dir: str | Path | None = None) -> Path:
    """The run's own folder for pushed weights: output_dir/.vllm_weights, or one named after output_dir inside
    vllm_weights_dir (which other runs may share); only its policy-* folders are ever removed. `output_dir`: the
    run's, where the config's is not it (eval's default: the model folder)."""
    output_dir = Path(output_dir or config.output_dir)
    if not config.vllm_weights_dir:
        return output_dir / WEIGHTS_FOLDER
    run = hashlib.blake2b(str(output_dir.resolve()).encode(), digest_size=6).hexdigest()
    return Path(config.vllm_weights_dir) / f"fsdp-recipes-{run}"


class ServerWeights:
    """Which policy version (optimizer steps taken) the server holds, and the pushes that keep it current."""

    def __init__(self, accelerator, server: VLLMServer, root: Path, on_every_rank: Callable):
        self.accelerator, self.server, self.root, self.on_every_rank = accelerator, server, Path(root), on_every_rank
        self.dtype = getattr(torch, server.info.dtype, None)
        self.version: int | None = None  # unknown at start: whatever the server loaded, or a previous run pushed
        self.pushes, self.seconds = 0, 0.0

        def claim() -> None:  # this run's policy from now on: another run's later push is refused, and ours after it
            if accelerator.is_main_process:
                server.claim()
                for stale in self.root.glob("policy-*"):  # a stopped run's last folder
                    shutil.rmtree(stale, ignore_errors=True)

        on_every_rank(claim)

    @classmethod
    def for_run(cls, run, config, output_dir: str | Path | None = None) -> ServerWeights | None:
        """The pushes of a run that generates through its vLLM server (`run.generation_server`); None without one.
        `output_dir`: where the run writes, where the config's is not it (eval's default: the model folder)."""
        if run.generation_server is None:
            return None
        root = weights_root(config, output_dir)
        return cls(run.accelerator, run.generation_server, root, run.on_every_rank)

    @property
    def main_process(self) -> bool:
        return self.accelerator.is_main_process

    def push(self, model: torch.nn.Module, version: int) -> bool:
        """Collective. The server gets `model`'s weights unless it holds `version` already; True when it loaded them.
        A failure (the server gone, the disk full) stops every rank together."""
        if version == self.version:
            return False
        started = time.perf_counter()
        folder = self.root / f"policy-{version:07d}"

        def write_and_load() -> None:
            written = serving_weights.write_serving_weights(self.accelerator, model, folder, dtype=self.dtype)
            if written is not None:
                self.server.load_weights(str(written.resolve()))
                for older in self.root.glob("policy-*"):
                    if older != folder:
                        shutil.rmtree(older, ignore_errors=True)

        self.on_every_rank(write_and_load)
        self.version = version
        self.pushes += 1
        self.seconds += time.perf_counter() - started
        return True

    def close(self) -> dict:
        """The last folder removed (the server keeps what it loaded), and the run's folder if nothing else is in it;
        the pushes' count and seconds, for the run summary."""
        if self.accelerator.is_main_process and self.root.is_dir():
            for folder in self.root.glob("policy-*"):
                shutil.rmtree(folder, ignore_errors=True)
            if not any(self.root.iterdir()):
                self.root.rmdir()
        return {"vllm_weight_pushes": self.pushes, "vllm_weight_push_seconds": round(self.seconds, 3)}


@contextlib.contextmanager
def resumable_when_the_server_fails(output_dir: str | Path, *, main_process: bool) -> Iterator[None]:
    """Around a training run's work with its server: a ServerError says how to go on. With a checkpoint, the main
    process marks it as the one to resume (`train.preemption`: the same command then resumes from it by itself)."""
    try:
        yield
    except ServerError as error:
        latest = latest_checkpoint(output_dir)
        if latest is None:
            raise ServerError(
                f"{error}; no checkpoint was saved yet: once the server answers, start the run again with "
                "overwrite_output_dir: true"
            ) from None
        if main_process:
            preemption.mark_preempted(output_dir, latest, why="stopped by its vLLM server")
        raise ServerError(f"{error}; once the server answers, the same command resumes from {latest.name}") from None
