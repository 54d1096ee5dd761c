"""`fsdp-recipes vllm-serve`: vLLM's own OpenAI-compatible server (`vllm serve`), started from the vLLM environment
for a model, with what the recipes need to generate through it and push weights to it (docs/vllm.md):

- `VLLM_SERVER_DEV_MODE=1`: the `/collective_rpc` and `/reset_prefix_cache` endpoints a run loads weights through;
- `--worker-extension-cls`: the two methods of `fsdp_recipes.train.vllm_worker` on every worker, copied beside the
  server as a module of its own (the vLLM environment has none of the recipes' packages, and needs none);
- `--logprobs-mode processed_logprobs`: each token's log-probability after temperature, top-k and top-p, which is
  what the importance-sampling correction divides by (TRL's choice);
- on a machine without a GPU: float32 unless `--dtype` says otherwise, `--enforce-eager`, chunked prefill off (it rewinds a seeded request's generator, which
  CPU generators cannot: the engine died once a round's prompts outgrew a step's token budget), and
  `VLLM_CPU_KVCACHE_SPACE` (1 GiB) and `VLLM_CPU_OMP_THREADS_BIND` (nobind) where the environment does not set them; with one rank, the worker inside the engine's process
  (`--distributed-executor-backend uni`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`): one Python start-up less.

The checks before the server starts (an error line each): the vLLM environment, the model folder, the port, and
tensor x data parallel ranks against the machine's GPUs (CPU cores without one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_recipes.common.errors import ConfigError

VLLM_PYTHON_ENV = "FSDP_RECIPES_VLLM_PYTHON"
REPO_VLLM_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"  # a checkout's `make venv`
EXTENSION_MODULE = "fsdp_recipes_vllm_worker"
EXTENSION_CLASS = "WeightSync"
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the model the run trains or evaluates: its folder or Hub id")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: this machine only; 0.0.0.0 serves trainers on other machines, and "
        "anyone who reaches the port can then load weights into it)",
    )
    parser.add_argument("--port", type=int, default=8000, help="the port (TRL's vllm_server_port default)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each copy of the model spans")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="copies of the model serving requests")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + completion tokens per request (default: the model's)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="the weights' dtype in vLLM (default: auto, vLLM's choice, on a GPU; float32 without one: vLLM's CPU "
        "engine died at its first request on bf16 weights here, and an fp32 trainer's log-probabilities match it)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="the share of each GPU vLLM takes (vLLM's 0.9)"
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help=f"the vLLM environment's python (default: ${VLLM_PYTHON_ENV}, then this checkout's .venv-vllm, then the "
        "python of `vllm` on PATH)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and its environment; start nothing")
    parser.add_argument("vllm_args", nargs="*", help="after --: more arguments for vLLM's server, passed as they are")


def vllm_python(explicit: Path | None) -> Path:
    """The vLLM environment's interpreter; ConfigError naming where it was looked for, and how to make one."""
    candidates = []
    if explicit is not None:
        candidates = [("--vllm-python", explicit)]
    elif os.environ.get(VLLM_PYTHON_ENV):
        candidates = [(VLLM_PYTHON_ENV, Path(os.environ[VLLM_PYTHON_ENV]))]
    else:
        candidates.append((".venv-vllm", REPO_VLLM_VENV / "bin" / "python"))
        on_path = shutil.which("vllm")
        if on_path:
            candidates.append(("vllm on PATH", Path(on_path).with_name("python")))
    for _, python in candidates:
        if python.is_file() and _has_vllm(python):
            return python
    looked = "; ".join(f"{where}: {python}" for where, python in candidates) or "nowhere"
    raise ConfigError(
        f"no vLLM environment found (looked at {looked}): run `make venv` in this checkout (it makes .venv-vllm), or "
        f"make one (python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm) and pass --vllm-python"
    )


def _has_vllm(python: Path) -> bool:
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def device_count() -> tuple[int, str]:
    """(how many ranks this machine can give a server, what they are): its GPUs, or its CPU cores without one."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU(s)"
    return os.cpu_count() or 1, "CPU core(s) and no GPU"


def problems(args: argparse.Namespace) -> list[str]:
    found = []
    model = Path(args.model).expanduser()
    looks_local = model.exists() or args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
    if looks_local and not (model / "config.json").is_file():
        found.append(
            f"--model {args.model}: no model folder there (no config.json): give the folder the run's "
            "model_name_or_path names, or a Hub id"
        )
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, name) < 1:
            found.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        found.append(f"--max-model-len must be >= 2 (prompt + completion tokens), got {args.max_model_len}")
    elif args.max_model_len is not None and (model / "config.json").is_file():
        positions = _positions(model / "config.json")
        if positions is not None and args.max_model_len > positions:
            found.append(
                f"--max-model-len {args.max_model_len} is more than the model's {positions} positions "
                "(max_position_embeddings), which vLLM refuses: lower it, or extend the model's positions (rope "
                "scaling in its config.json)"
            )
    if not found:
        count, what = device_count()
        ranks = args.tensor_parallel_size * args.data_parallel_size
        if ranks > count:
            found.append(
                f"--tensor-parallel-size {args.tensor_parallel_size} x --data-parallel-size {args.data_parallel_size} "
                f"= {ranks} ranks, but this machine has {count} {what}: lower them, or start the server where there "
                "are enough"
            )
    if not args.dry_run and _port_taken(args.host, args.port):
        found.append(
            f"port {args.port} on {args.host} is in use (a server already running?): stop it, or pick another --port "
            "and give the run the same vllm_server_port"
        )
    return found


def _positions(config_file: Path) -> int | None:
    import json

    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, (int, float)) else None


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def server_command(args: argparse.Namespace, python: Path, extension_dir: Path, *, gpu: bool):
    """(argv, the environment's additions) of the server."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    dtype = args.dtype or ("auto" if gpu else "float32")
    argv += ["--host", args.host, "--port", str(args.port), "--dtype", dtype, "--seed", "0"]
    argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    argv += ["--data-parallel-size", str(args.data_parallel_size)]
    argv += ["--logprobs-mode", "processed_logprobs"]
    argv += ["--worker-extension-cls", f"{EXTENSION_MODULE}.{EXTENSION_CLASS}"]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if not gpu and "--enforce-eager" not in args.vllm_args:
        argv.append("--enforce-eager")  # torch.compile on CPU costs minutes at start for little
    if not gpu and not any("chunked-prefill" in word or "max-num-batched-tokens" in word for word in args.vllm_args):
        # Chunked prefill rewinds a seeded request's generator, which a CPU generator cannot do ("CPU Generator does
        # not use offset"): the engine died on the first round whose prompts outgrew a step's token budget.
        longest = args.max_model_len or _positions(Path(args.model) / "config.json") or 0
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(2048, longest))]
    one_rank = not gpu and args.tensor_parallel_size == args.data_parallel_size == 1
    if one_rank and "--distributed-executor-backend" not in args.vllm_args:
        argv += ["--distributed-executor-backend", "uni"]  # the worker inside the engine's process: ~15 s less start
    argv += list(args.vllm_args)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = str(extension_dir) + (os.pathsep + path if path else "")
    if not gpu:
        env.update({name: value for name, value in CPU_DEFAULTS.items() if name not in os.environ})
    if one_rank:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    return argv, env


def extension_folder() -> Path:
    """A folder holding the worker extension as a module of its own, for the server's path."""
    from fsdp_recipes.train import vllm_worker

    folder = Path(tempfile.mkdtemp(prefix="fsdp-recipes-vllm-"))
    shutil.copyfile(vllm_worker.__file__, folder / f"{EXTENSION_MODULE}.py")
    return folder


def run(args: argparse.Namespace) -> int:
    """Checks, then becomes the server (exec: signals reach vLLM itself, and its exit status is the command's)."""
    python = vllm_python(args.vllm_python)
    found = problems(args)
    if found:
        raise ConfigError(found)
    gpu = device_count()[1] == "GPU(s)"
    folder = extension_folder()
    argv, env = server_command(args, python, folder, gpu=gpu)
    for name, value in env.items():
        print(f"{name}={value}", file=sys.stderr)
    print(" ".join(argv), file=sys.stderr, flush=True)
    if args.dry_run:
        shutil.rmtree(folder, ignore_errors=True)
        return 0
    os.execve(argv[0], argv, {**os.environ, **env})
    return 0  # not reached
