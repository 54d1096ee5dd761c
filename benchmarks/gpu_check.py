"""The one prepared GPU run (docs/gpu.md): every measurement the CPU rehearsal cannot make, in priority order, under
one deadline, each step in its own process with its own timeout, every result into one JSON file.

    python benchmarks/gpu_check.py --out outputs/gpu_check            # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --out /tmp/gpu_dry --dry-run       # the same steps on CPU at toy sizes (~12 min)

Steps, in the order of issue 50's priorities (a step that fails is recorded with its output's tail, and the run goes on;
a step that would start too near the deadline is skipped and recorded as skipped):
 1. versions and device;
 2. the memory estimator's prediction for the 1.1B SFT (benchmarks/llama_1b.json, recipes/configs/sft/gpu_check_1b.yaml)
    at batch 4 and at batch 16, beside the measured peaks of the steps below;
 3. that SFT under FSDP2 bf16 on one GPU (accelerate_configs/fsdp_8gpu.yaml, one process), through recipes/sft.py, at
    batch 16 with sdpa, its export and read-back: tokens/s, MFU, step time, peak memory; its model is what the GRPO
    and LoRA steps load. Then the fast path at batch 16, the loop only (first_step_time_s holds the compile pause):
    FlexAttention, + compile, + liger-kernel (use_liger_kernel, loss_implementation liger);
 4. TRL's SFTTrainer on the same model, data and rows at batch 16, packed padding-free, Liger on
    (benchmarks/sft_vs_trl.py; runs where trl is importable);
 5. GRPO from the exported model, with generation_backend generate and then paged: the step-time shares; then each
    generation backend's completion tokens/s, 64 prompts x 8 at 32 and 256 new tokens
    (benchmarks/generation_backends.py); then GRPO through a vLLM server on the same GPU, where the machine has a
    vLLM environment (recorded as skipped where it has none);
 6. float8 on the fast path at batch 16 (fsdp_8gpu_float8.yaml: torchao's float8 matmuls, FSDP2 gathering float8
    weights); then the same routes and TRL at batch 4 (sdpa, flex, + compile, + liger, + float8);
 7. what the 4 December run measured, again if time is left: torch's loss kernels at a 128k vocabulary
    (benchmarks/chunked_loss_memory.py), activation checkpointing, LoRA and QLoRA on the exported model, a
    ~400M-parameter Qwen3-MoE (benchmarks/qwen3_moe_small.json).
On the CPU dry run, flex has no backward and Liger's kernels are Triton's: those steps run with sdpa and without Liger,
to rehearse everything else; float8 runs where torchao is importable, TRL where trl is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = "recipes/configs/sft/gpu_check_1b.yaml"


class Check:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"dry_run": args.dry_run, "steps": {}}
        self.deadline = time.monotonic() + args.budget_s
        self.log = open(self.out / "gpu_check.log", "a")
        self.env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
        self.env["PYTHONUNBUFFERED"] = "1"
        if args.dry_run:
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    # --------------------------------------------------------------------------------------------------- plumbing
    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, name: str, value: dict) -> None:
        self.results["steps"][name] = value
        print(f"== {name}: {json.dumps(value, default=str)[:600]}", flush=True)
        self.save()

    def run(self, name: str, command: list[str], *, timeout: float, until_metrics: tuple[Path, int] | None = None):
        """Run `command`, its output to the log; (return code, seconds, output tail). With `until_metrics`
        (metrics.jsonl, last step) the process group is killed once that step's training record is written."""
        timeout = min(timeout, self.left())
        if timeout < 20:
            return None, 0.0, "skipped: the run's deadline is near"
        self.log.write(f"\n\n===== {name}: {' '.join(command)}\n")
        self.log.flush()
        started = time.monotonic()
        tail_path = self.out / f".{name}.out"
        with open(tail_path, "w") as sink:
            process = subprocess.Popen(
                command, cwd=REPO, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            code = None
            while code is None:
                try:
                    code = process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    if time.monotonic() - started > timeout:
                        os.killpg(process.pid, signal.SIGKILL)
                        code = process.wait()
                        code = "timeout"
                    elif until_metrics and _logged_step(*until_metrics):
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
                        code = "stopped after training"
        text = tail_path.read_text(errors="replace")
        self.log.write(text)
        self.log.flush()
        tail_path.unlink()
        return code, round(time.monotonic() - started, 1), text[-3000:]

    def accelerate(self, config: str, script: str, *arguments: str) -> list[str]:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1"]
        return [*launch, script, *arguments]

    # ------------------------------------------------------------------------------------------------------ steps
    def versions(self) -> None:
        probe = (
            "import json, importlib, torch; v = {}\n"
            "for n in ('torch','transformers','accelerate','peft','datasets','evaluate','bitsandbytes',"
            "'huggingface_hub','safetensors','tokenizers','pyarrow'):\n"
            "    try: v[n] = importlib.import_module(n).__version__\n"
            "    except Exception as e: v[n] = f'missing: {e}'[:120]\n"
            "v['device'] = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'\n"
            "v['gpu_memory_gib'] = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0\n"
            "v['linear_cross_entropy'] = hasattr(torch.nn.functional, 'linear_cross_entropy')\n"
            "print(json.dumps(v))"
        )
        code, seconds, text = self.run("versions", [sys.executable, "-c", probe], timeout=120)
        self.record("versions", json.loads(text.strip().splitlines()[-1]) if code == 0 else {"error": text})

    def estimate(self) -> None:
        for name, config, batch in (
            ("estimate", "fsdp_8gpu.yaml", 4),
            ("estimate_bs16", "fsdp_8gpu.yaml", 16),
            ("estimate_ac", "fsdp_8gpu_activation_checkpointing.yaml", 4),
        ):
            command = [sys.executable, "-m", "fsdp_recipes.tools.cli", "estimate", "--model", self.model_config()]
            command += ["--accelerate-config", f"accelerate_configs/{config}", "--num-processes", "1"]
            command += ["--recipe-config", SFT_CONFIG, "--json", "--batch-size", str(batch)]
            command += ["--max-length", "128"] if self.args.dry_run else []
            code, seconds, text = self.run(name, command, timeout=120)
            try:
                self.record(name, {"rc": code, **json.loads(text[text.index("{") :])})
            except ValueError:
                self.record(name, {"rc": code, "tail": text})

    def sft(self, name: str, config: str, *extra: str, steps: int, loop_only: bool = False, batch: int = 4) -> Path:
        output = self.out / name
        command = self.accelerate(
            f"accelerate_configs/{config}", "recipes/sft.py", "--config", SFT_CONFIG, "--output_dir", str(output),
            "--max_steps", str(steps), "--per_device_train_batch_size", str(batch), *self.sizes(), *extra,
        )  # fmt: skip
        until = (output / "metrics.jsonl", steps) if loop_only else None
        code, seconds, text = self.run(name, command, timeout=240 if loop_only else 300, until_metrics=until)
        self.record(name, {"rc": code, "seconds": seconds, **training_figures(output), **failure(code, text)})
        return output

    def trl_sft(self, name: str, batch: int, *, flex: bool, liger: bool) -> None:
        """TRL's SFTTrainer on the same work (benchmarks/sft_vs_trl.py), one process, no FSDP."""
        if importlib.util.find_spec("trl") is None:
            self.record(name, {"skipped": "trl is not importable (benchmarks/gpu_wheels.sh carries it)"})
            return
        command = [sys.executable, "benchmarks/sft_vs_trl.py", "--batch-size", str(batch)]
        command += ["--out", str(self.out / name)]
        command += ["--attn", "flex_attention"] if flex else []
        command += ["--liger"] if liger else []
        if self.args.dry_run:
            command += ["--model-config", "demo/tiny_llama.json", "--max-length", "128", "--steps", "6"]
            command += ["--warmup-steps", "2"]
        else:
            command += ["--steps", "15"]
        code, seconds, text = self.run(name, command, timeout=240)
        try:
            figures = json.loads(text[text.rindex("== report") + len("== report") :].splitlines()[0])
            self.record(name, {"rc": code, "seconds": seconds, **figures})
        except ValueError:
            self.record(name, {"rc": code, "seconds": seconds, "tail": text[-3000:]})

    def loss_kernels(self) -> None:
        command = [sys.executable, "benchmarks/chunked_loss_memory.py", "--json"]
        command += ["--device", "cpu", "--hidden", "64", "--rows", "2"] if self.args.dry_run else ["--device", "cuda"]
        command += [] if self.args.dry_run else ["--hidden", "2048", "--rows", "8"]
        code, seconds, text = self.run("loss_kernels", command, timeout=180)
        try:
            self.record("loss_kernels", {"rc": code, "seconds": seconds, **json.loads(text[text.index("{") :])})
        except ValueError:
            self.record("loss_kernels", {"rc": code, "tail": text})

    def grpo(self, base: Path) -> None:
        """GRPO from the exported model with `generate`, then with the paged engine (the step-time shares of each
        from metrics.jsonl), then every generation backend's tokens/s on 64 prompts x 8 at 32 and 256 new tokens."""
        for name, backend in (("grpo", "generate"), ("grpo_paged", "paged")):
            output = self.out / name
            command = self.accelerate(
                "accelerate_configs/fsdp_8gpu.yaml", "recipes/grpo.py", "--config",
                "recipes/configs/grpo/demo_reverse.yaml", "--model_name_or_path", str(base), "--output_dir", str(output),
                "--max_steps", "6", "--logging_steps", "1", "--save_steps", "null", "--warmup_steps", "0",
                "--max_completion_length", "32", "--max_length", "64", "--generation_backend", backend,
                "--per_device_train_batch_size", "64" if not self.args.dry_run else "16",
                "--per_device_eval_batch_size", "64" if not self.args.dry_run else "16",
            )  # fmt: skip
            code, seconds, text = self.run(name, command, timeout=240)
            self.record(name, {"rc": code, "seconds": seconds, **failure(code, text), **step_shares(output)})
        command = [sys.executable, "benchmarks/generation_backends.py", "--model", str(base), "--rounds", "1"]
        if self.args.dry_run:
            command += ["--prompts", "8", "--generations", "2", "--max-new-tokens", "8", "--compile-backend", "eager"]
        else:
            command += ["--max-new-tokens", "32", "256", "--device", "cuda", "--dtype", "bfloat16"]
        code, seconds, text = self.run("generation_backends", command, timeout=300)
        try:
            figures = json.loads(text[text.rindex("== report") + len("== report") :])
            self.record("generation_backends", {"rc": code, "seconds": seconds, **figures})
        except ValueError:
            self.record("generation_backends", {"rc": code, "tail": text[-3000:]})

    def grpo_vllm(self, base: Path) -> None:
        """GRPO from the exported model generating through a vLLM server on the same GPU (a third of its memory:
        TRL's colocated share), weights pushed after each step: the step-time shares against `grpo` above. Needs a
        vLLM environment (`make venv`'s .venv-vllm, or $FSDP_RECIPES_VLLM_PYTHON); vLLM's CUDA wheel (~400 MB) is
        over what a device call carries, so the step is recorded as skipped on a machine without one."""
        from fsdp_recipes.common.errors import ConfigError
        from fsdp_recipes.tools.vllm_serve import vllm_python

        try:
            python = vllm_python(None)
        except ConfigError as error:
            self.record("grpo_vllm", {"skipped": str(error)})
            return
        port = 8000 + os.getpid() % 1000
        serve = [sys.executable, "-m", "fsdp_recipes.tools.cli", "vllm-serve", "--model", str(base)]
        serve += ["--port", str(port), "--vllm-python", str(python), "--max-model-len", "128"]
        serve += [] if self.args.dry_run else ["--gpu-memory-utilization", "0.3"]
        log = open(self.out / "vllm_server.log", "w")
        server = subprocess.Popen(serve, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            output = self.out / "grpo_vllm"
            command = self.accelerate(
                "accelerate_configs/fsdp_8gpu.yaml", "recipes/grpo.py", "--config",
                "recipes/configs/grpo/demo_reverse.yaml", "--model_name_or_path", str(base), "--output_dir", str(output),
                "--max_steps", "6", "--logging_steps", "1", "--save_steps", "null", "--warmup_steps", "0",
                "--max_completion_length", "32", "--max_length", "64", "--generation_backend", "vllm",
                "--vllm_server_port", str(port), "--vllm_server_timeout", "300",
                "--per_device_train_batch_size", "64" if not self.args.dry_run else "16",
            )  # fmt: skip
            code, seconds, text = self.run("grpo_vllm", command, timeout=420)
            self.record("grpo_vllm", {"rc": code, "seconds": seconds, **failure(code, text), **step_shares(output)})
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    # ------------------------------------------------------------------------------------------------------ sizes
    def model_config(self) -> str:
        return "demo/tiny_llama.json" if self.args.dry_run else "benchmarks/llama_1b.json"

    def moe_config(self) -> str:
        if not self.args.dry_run:
            return "benchmarks/qwen3_moe_small.json"
        config = json.loads((REPO / "benchmarks" / "qwen3_moe_small.json").read_text())
        config.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)  # fmt: skip
        path = self.out / "qwen3_moe_tiny.json"
        path.write_text(json.dumps(config))
        return str(path)

    def sizes(self) -> list[str]:
        if self.args.dry_run:
            return ["--model_config", "demo/tiny_llama.json", "--max_length", "128", "--logging_steps", "2"]
        return []


def _logged_step(metrics: Path, step: int) -> bool:
    try:
        return any(
            '"loss"' in line and json.loads(line).get("step") == step for line in metrics.read_text().splitlines()
        )
    except (OSError, ValueError):
        return False


def training_figures(output: Path) -> dict:
    """Means over the logged windows after the first (the first holds start-up and compilation)."""
    try:
        lines = (output / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {"figures": "no metrics.jsonl"}
    records = [json.loads(line) for line in lines if '"loss"' in line and '"tokens_per_second_per_device"' in line]
    steady = records[1:] or records
    if not steady:
        return {"figures": "no training record"}

    def mean(key):
        values = [r[key] for r in steady if isinstance(r.get(key), int | float)]
        return sum(values) / len(values) if values else None

    return {
        "windows": len(steady),
        "losses": [r["loss"] for r in records],
        "tokens_per_second_per_device": mean("tokens_per_second_per_device"),
        "mfu": mean("mfu"),
        "achieved_flops_per_device": mean("achieved_flops_per_device"),
        "step_time_s": mean("step_time_s"),
        # the compile pause beyond the first step: the first window's steps, against the steady ones
        "first_window_step_time_s": records[0].get("step_time_s"),
        "first_step_time_s": next(
            (r["first_step_time_s"] for r in map(json.loads, lines) if "first_step_time_s" in r), None
        ),
        "peak_memory_gib": max(max(r.get("peak_memory_gib_per_rank") or [0]) for r in records),
        "peak_allocated_gib": max(max(r.get("peak_allocated_gib_per_rank") or [0]) for r in records),
        "padding_fraction": mean("padding_fraction"),
        "extra": {k: v for k, v in steady[-1].items() if k.startswith(("aux", "router"))},
    }


def step_shares(output: Path) -> dict:
    """A GRPO run's means over its logged steps after the first: the generation share and generated tokens/s."""
    try:
        records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return {}
    steady = [r for r in records if r.get("step", 0) >= 2 and "time/generation_share" in r]
    if not steady:
        return {}
    return {
        key: round(sum(r[key] for r in steady) / len(steady), 3)
        for key in (
            "time/generation_share",
            "time/scoring_share",
            "time/training_share",
            "time/weight_sync_share",
            "tokens/generated_per_second",
            "step_time_s",
        )
        if all(key in r for r in steady)
    }


def failure(code, text: str) -> dict:
    return {} if code in (0, "stopped after training") else {"tail": text[-2500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: rehearse every step")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="no step runs past this many seconds (default: 480; dry run 1800)"
    )
    parser.add_argument("--only", nargs="*", help="run only these steps (by name; for a rerun)")
    args = parser.parse_args()
    args.budget_s = args.budget_s or (1800 if args.dry_run else 480)
    check = Check(args)
    wanted = lambda name: not args.only or name in args.only  # noqa: E731
    steps_base, steps_variant = (6, 4) if args.dry_run else (20, 15)
    on_gpu = not args.dry_run
    has = lambda package: importlib.util.find_spec(package) is not None  # noqa: E731
    check.versions()
    if wanted("estimate"):
        check.estimate()
    # 1. the routes at batch 16, where one GPU is kept busy (4 December: 1.5x batch 4's speed at sdpa). The first
    # run exports the model that GRPO and LoRA load. Flex is what `auto` takes on CUDA; the check's config pins sdpa.
    flex = ["--attn_implementation", "flex_attention"] if on_gpu else []
    compile_on = ["--torch_compile", "true"]
    liger = ["--use_liger_kernel", "true", "--loss_implementation", "liger"] if on_gpu else []
    # batch 16 with sdpa's mask reserved 88 GiB on 4 December: an 80 GB card exports its model from batch 4 instead
    gpu_memory = check.results["steps"]["versions"].get("gpu_memory_gib") or 0
    base_batch = 16 if args.dry_run or gpu_memory > 100 else 4
    base = check.out / "sft_bf16"
    if wanted("sft_bf16"):
        base = check.sft("sft_bf16", "fsdp_8gpu.yaml", batch=base_batch, steps=steps_base)
    routes = {
        "flex": ("fsdp_8gpu.yaml", flex),
        "flex_compile": ("fsdp_8gpu.yaml", flex + compile_on),
        "flex_compile_liger": ("fsdp_8gpu.yaml", flex + compile_on + liger),
        "flex_compile_liger_float8": ("fsdp_8gpu_float8.yaml", flex + compile_on + liger),
    }

    def route(name: str, batch: int) -> None:
        config, extra = routes[name]
        step = f"sft_bs{batch}_{name}"
        if not wanted(step):
            return
        if name.endswith("float8") and not has("torchao"):
            check.record(step, {"skipped": "torchao is not importable (benchmarks/gpu_wheels.sh carries it)"})
            return
        check.sft(step, config, *extra, batch=batch, steps=steps_variant, loop_only=True)

    for name in ("flex", "flex_compile", "flex_compile_liger"):
        route(name, 16)
    # 2. TRL's SFTTrainer on the same rows: the ratio to the recipe's best
    if wanted("trl_bs16"):
        check.trl_sft("trl_bs16", 16, flex=on_gpu, liger=on_gpu)
    # 3. GRPO generation with each backend
    if wanted("grpo"):
        check.grpo(base)
    if wanted("grpo_vllm"):
        check.grpo_vllm(base)
    # 4. float8, then batch 4 (4 December measured sdpa at batch 4: 28,903 tokens/s)
    route("flex_compile_liger_float8", 16)
    if wanted("sft_bs4_sdpa"):
        check.sft("sft_bs4_sdpa", "fsdp_8gpu.yaml", batch=4, steps=steps_variant, loop_only=True)
    for name in routes:
        route(name, 4)
    if wanted("trl_bs4"):
        check.trl_sft("trl_bs4", 4, flex=on_gpu, liger=on_gpu)
    # 5. again what 4 December measured, if time is left
    if wanted("loss_kernels"):
        check.loss_kernels()
    if wanted("sft_bf16_ac"):
        check.sft("sft_bf16_ac", "fsdp_8gpu_activation_checkpointing.yaml", steps=steps_variant, loop_only=True)
    if wanted("lora"):
        check.sft("lora", "fsdp_8gpu.yaml", "--model_name_or_path", str(base), "--model_config", "null",
                  "--use_peft", "true", steps=steps_variant)  # fmt: skip
    # bitsandbytes' 4-bit layers need CUDA under FSDP here; its wheel (43 MB) is not carried with the others
    if wanted("qlora") and has("bitsandbytes") and on_gpu:
        check.sft("qlora", "fsdp_8gpu.yaml", "--model_name_or_path", str(base), "--model_config", "null",
                  "--use_peft", "true", "--load_in_4bit", "true", "--bnb_4bit_compute_dtype", "bfloat16",
                  "--bnb_4bit_quant_storage", "bfloat16", steps=steps_variant)  # fmt: skip
    if wanted("moe"):
        check.sft("moe", "fsdp_8gpu.yaml", "--model_config", check.moe_config(), steps=steps_variant, loop_only=True)
    check.results["seconds_left_of_budget"] = round(check.left())
    check.save()
    print(f"== done: {check.out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
