"""The vLLM settings of a recipe that generates (grpo, distill, eval), under TRL's names and meaning: `use_vllm: true`
is `generation_backend: vllm` here (common/key_translation.py), and these fields say which server and how long to
wait for it. `connect` runs at start, on every rank, before any weights load: the server answers, holds a model of
the run's model's shapes, takes the run's longest rows and reports the log-probabilities it samples from."""

from __future__ import annotations

import dataclasses
import math

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.train.vllm_client import ServerError, VLLMServer, serving_problems

VLLM_MODES = ("server", "colocate")
COLOCATE_PROBLEM = (
    "vllm_mode colocate runs vLLM inside each training process, so one Python environment must hold both; vLLM's "
    "releases pin transformers<5.20 and these recipes need 5.24, so no such environment exists here (docs/vllm.md, "
    "Colocate): use vllm_mode server with a server started by `fsdp-recipes vllm-serve --model <model>`"
)


@dataclasses.dataclass
class VLLMFields:
    """Where completions come from when `generation_backend` is vllm (TRL's `use_vllm: true`)."""

    vllm_mode: str = setting(
        "server",
        "server: a vLLM server of its own (fsdp-recipes vllm-serve) that the run pushes its weights to; colocate: "
        "vLLM inside each training process (TRL's default; refused here, see docs/vllm.md)",
        resume="free",
        check=checks.one_of(VLLM_MODES),
    )
    vllm_server_base_url: str | None = setting(
        None, "the server's URL, e.g. http://10.0.0.2:8000 (null: vllm_server_host and vllm_server_port)", resume="free"
    )
    vllm_server_host: str = setting("0.0.0.0", "the server's host when no vllm_server_base_url is given", resume="free")
    vllm_server_port: int = setting(8000, "the server's port when no vllm_server_base_url is given", resume="free")
    vllm_server_timeout: float = setting(
        240.0,
        "seconds to wait at start for the server to answer (it may still be loading its model)",
        resume="free",
        check=checks.above(0),
    )
    vllm_request_timeout: float = setting(
        600.0,
        "seconds a generation pass or a weight load may take before the server is taken for hung and the run stops "
        "(on every rank, its last checkpoint kept): longer completions and bigger models need more",
        resume="free",
        check=checks.above(0),
    )
    vllm_weights_dir: str | None = setting(
        None,
        "where the policy's weights are written for the server to load after each step that changes them: a folder "
        "the server's machine reads; a RAM-backed one (/dev/shm/...) is fastest (null: output_dir/.vllm_weights)",
        resume="free",
    )
    # colocate's settings (TRL's); in server mode the server's own flags set them (fsdp-recipes vllm-serve)
    vllm_gpu_memory_utilization: float = setting(
        0.3, "colocate: the share of each GPU vLLM takes (server mode: vllm-serve's flag)", resume="free"
    )
    vllm_tensor_parallel_size: int = setting(
        1,
        "colocate: GPUs each vLLM engine spans; server mode: the tensor parallel size the server must run (1: any; "
        "start it with fsdp-recipes vllm-serve --tensor-parallel-size N)",
        resume="free",
        check=checks.at_least(1),
    )
    vllm_max_model_length: int | None = setting(
        None, "colocate: vLLM's context (server mode: vllm-serve --max-model-len)", resume="free"
    )
    vllm_enable_sleep_mode: bool = setting(
        False, "colocate: vLLM's weights and cache offloaded while the trainer runs (CUDA only)", resume="free"
    )

    def vllm_base_url(self) -> str:
        if self.vllm_server_base_url:
            return self.vllm_server_base_url
        return f"http://{self.vllm_server_host}:{self.vllm_server_port}"

    def longest_request(self) -> int:
        """Prompt + completion tokens a request may hold, checked against the server's context at start: a
        training recipe's rows are at most max_length."""
        return self.max_length

    def uses_vllm(self) -> bool:
        return getattr(self, "generation_backend", None) == "vllm"

    def cross_field_problems(self) -> list[str]:
        if not self.uses_vllm():
            return []
        problems = []
        if self.vllm_mode == "colocate":
            problems.append(COLOCATE_PROBLEM)
        if getattr(self, "load_in_4bit", False):
            problems.append(
                "use_vllm with load_in_4bit: the 4-bit base cannot be merged with the adapters into the weights the "
                "server loads (TRL refuses QLoRA with vLLM under FSDP too): train LoRA on a 16-bit base (load_in_4bit: "
                "false)"
            )
        if self.vllm_server_base_url and not self.vllm_server_base_url.startswith(("http://", "https://")):
            problems.append(
                f"vllm_server_base_url must start with http:// or https://, got {self.vllm_server_base_url!r}"
            )
        if not 1 <= self.vllm_server_port <= 65535:
            problems.append(f"vllm_server_port must be in 1..65535, got {self.vllm_server_port}")
        if not (math.isfinite(self.vllm_gpu_memory_utilization) and 0 < self.vllm_gpu_memory_utilization <= 1):
            problems.append(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        return problems


def connect(config, model_config, *, model_name: str, max_length: int, owner: str) -> VLLMServer | None:
    """The run's vLLM server, checked (ServerError or ConfigError: what is wrong and what to do); None when the run
    generates with transformers. `owner`: the run's output folder, which its pushes name."""
    if getattr(config, "generation_backend", None) != "vllm":
        return None
    server = VLLMServer.connect(
        config.vllm_base_url(), wait=config.vllm_server_timeout, request_timeout=config.vllm_request_timeout,
        model_name=model_name, owner=owner,
    )  # fmt: skip
    problems = serving_problems(server.info, model_config, model_name=model_name, max_length=max_length)
    wanted = config.vllm_tensor_parallel_size
    if wanted > 1 and wanted != server.info.tensor_parallel_size:
        problems.append(
            f"vllm_tensor_parallel_size {wanted}, but the {server.info.describe()} runs tensor parallel "
            f"{server.info.tensor_parallel_size}: in server mode the server's own size counts; restart it with "
            f"fsdp-recipes vllm-serve --tensor-parallel-size {wanted} (on a machine with that many GPUs), or remove "
            "vllm_tensor_parallel_size"
        )
    if problems:
        raise ServerError("; ".join(problems)) if len(problems) == 1 else ConfigError(problems)
    return server
