"""GRPO through vLLM against transformers' engines, and asynchronous rounds against synchronous ones (docs/vllm.md).

    python benchmarks/grpo_vllm.py backends --model outputs/demo_reverse_partial --steps 10
    python benchmarks/grpo_vllm.py backends --model 100m --steps 6 --prompts 4 --generations 4 --completion 32
    python benchmarks/grpo_vllm.py async --model outputs/demo_reverse_partial --steps 60 [--shared-cores]

backends: the GRPO recipe on one process, `generation_backend` generate, paged, static_compiled, then vllm (a server
started here with `fsdp-recipes vllm-serve`, fp32; --server-threads sets its OMP_NUM_THREADS: vLLM's CPU worker takes
one thread by default); the means over the steps after the first two (compile, warm-up)
of `step_time_s` (steps/s is its inverse), `tokens/generated_per_second` and `time/generation_share`. --model is a
model folder, or `100m` (a Llama of 85M parameters, 12 layers of 768, built here with random weights).

async: the same run through vLLM with async_generation false and true; trainer and server each pinned to a core of
their own (taskset) unless --shared-cores; steps/s and the held-out greedy exact match of each exported model (the
first 200 prompts of demo/assets/reverse_prompts/test.jsonl), so that rewards are compared at equal steps.

Everything runs from this checkout's .venv and .venv-vllm (`make venv`); results go to --out (JSON), a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CLI = str(Path(sys.executable).with_name("fsdp-recipes"))
PROMPTS = REPO / "demo" / "assets" / "reverse_prompts"
TOKENIZER = REPO / "demo" / "assets" / "tokenizer"
TRANSFORMERS_BACKENDS = ("generate", "paged", "static_compiled")


def model_folder(name: str, work: Path) -> Path:
    """A model folder: `name` itself, or the 85M-parameter Llama built here (random weights, the demo tokenizer)."""
    if name != "100m":
        return Path(name)
    folder = work / "llama_85m"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


class VLLMServer:
    def __init__(self, model: Path, port: int, cores: str | None, log: Path, threads: int | None = None):
        command = [CLI, "vllm-serve", "--model", str(model), "--dtype", "float32", "--port", str(port)]
        if cores:
            command = ["taskset", "-c", cores, *command]
        self.url = f"http://127.0.0.1:{port}"
        environment = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.process = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
            env=environment,
        )  # fmt: skip
        started = time.monotonic()
        while time.monotonic() - started < 300:
            if self.process.poll() is not None:
                raise SystemExit(f"the vLLM server exited: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def grpo(model: Path, output: Path, *, steps: int, backend: str, cores: str | None, args, **extra) -> dict:
    values = dict(
        model_name_or_path=str(model), dataset_name=str(PROMPTS), output_dir=str(output), max_length=args.completion + 28,
        max_completion_length=args.completion, num_generations=args.generations,
        per_device_train_batch_size=args.prompts * args.generations, per_device_eval_batch_size=64, max_steps=steps,
        temperature=0.7, learning_rate=3e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=2,
        scale_rewards="batch", reward_funcs=["exact_match", "partial_match"], logging_steps=1, save_steps=None,
        seed=42, report_to="none", generation_backend=backend, torch_compile_backend="inductor", **extra,
    )  # fmt: skip
    shutil.rmtree(output, ignore_errors=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    config = output.parent / f"{output.name}.yaml"
    import yaml

    config.write_text(yaml.safe_dump(values))
    command = [PYTHON, str(REPO / "recipes" / "grpo.py"), "--config", str(config)]
    if cores:
        command = ["taskset", "-c", cores, *command]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"{backend}: exit {result.returncode}\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps_run = [r for r in records if "loss" in r and r["step"] > 2]
    mean = lambda key: statistics.mean(r[key] for r in steps_run if key in r)  # noqa: E731
    return {
        "step_time_s": mean("step_time_s"),
        "steps_per_second": 1 / mean("step_time_s"),
        "completion_tokens_per_second": mean("tokens/generated_per_second"),
        "generation_share": mean("time/generation_share"),
        "reward_last_5": statistics.mean(r["reward"] for r in steps_run[-5:]),
        "wall_s": time.monotonic() - started,
    }


def backends(args, work: Path) -> dict:
    model = model_folder(args.model, work)
    results = {}
    for backend in [name for name in TRANSFORMERS_BACKENDS if name in args.backends]:
        results[backend] = grpo(model, work / backend, steps=args.steps, backend=backend, cores=None, args=args)
        print(backend, results[backend], flush=True)
    if "vllm" not in args.backends:
        return results
    server = VLLMServer(model, args.port, None, work / "server.log", threads=args.server_threads)
    try:
        results["vllm"] = grpo(
            model, work / "vllm", steps=args.steps, backend="vllm", cores=None, args=args,
            vllm_server_base_url=server.url,
        )  # fmt: skip
        results["vllm"]["server_start_s"] = server.start_seconds
        results["vllm"]["server_threads"] = args.server_threads or "vLLM's default (1 here)"
        print("vllm", results["vllm"], flush=True)
    finally:
        server.stop()
    return results


def held_out_exact_match(folder: Path, count: int = 200) -> float:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from grpo_demo import greedy_exact_match

    rows = [json.loads(line) for line in (PROMPTS / "test.jsonl").read_text().splitlines()[:count]]
    return greedy_exact_match(str(folder), rows, max_new_tokens=12)


def asynchronous(args, work: Path) -> dict:
    model = model_folder(args.model, work)
    trainer_cores, server_cores = (None, None) if args.shared_cores else ("0", "1")
    results = {"before": held_out_exact_match(model)}
    server = VLLMServer(model, args.port, server_cores, work / "server.log")
    try:
        for name, extra in (("sync", {}), ("async", {"async_generation": True})):
            results[name] = grpo(
                model, work / name, steps=args.steps, backend="vllm", cores=trainer_cores, args=args,
                vllm_server_base_url=server.url, **extra,
            )  # fmt: skip
            results[name]["held_out_exact_match"] = held_out_exact_match(work / name)
            print(name, results[name], flush=True)
    finally:
        server.stop()
    results["speedup"] = results["async"]["steps_per_second"] / results["sync"]["steps_per_second"]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("backends", "async"))
    parser.add_argument("--model", required=True, help="a model folder, or 100m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion", type=int, default=12, help="max_completion_length")
    parser.add_argument("--shared-cores", action="store_true", help="async: trainer and server not pinned")
    parser.add_argument("--backends", nargs="+", default=[*TRANSFORMERS_BACKENDS, "vllm"], help="backends: which")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="backends: OMP_NUM_THREADS for the server (vLLM's CPU default: 1)",
    )
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/grpo_vllm"))
    args = parser.parse_args()
    label = f"{args.what}-{Path(args.model).name}" + ("-shared" if args.shared_cores else "")
    label += f"-threads{args.server_threads}" if args.server_threads else ""
    work = args.out / label
    work.mkdir(parents=True, exist_ok=True)
    results = backends(args, work) if args.what == "backends" else asynchronous(args, work)
    results["command"] = " ".join(sys.argv)
    (args.out / f"{label}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
