"""The one prepared GPU run (docs/gpu.md): every measurement the CPU rehearsal cannot make, in priority order, under
one deadline, each step in its own process with its own timeout, every result into one JSON file.

    python benchmarks/gpu_check.py --out outputs/gpu_check            # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --out /tmp/gpu_dry --dry-run       # the same steps on CPU at toy sizes (~4 min)

Steps (a step that fails is recorded with its output's tail, and the run goes on):
 1. versions and device;
 2. the memory estimator's prediction for the 1.1B SFT (benchmarks/llama_1b.json, recipes/configs/sft/gpu_check_1b.yaml);
 3. that SFT under FSDP2 bf16 on one GPU (accelerate_configs/fsdp_8gpu.yaml, one process), through recipes/sft.py
    with its export and read-back: tokens/s, MFU, step time, peak memory; its model is what steps 5, 6 and 8 load;
 3b. the fast path on the same SFT, the loop only (first_step_time_s holds the compile pause): FlexAttention, + compile,
    + liger-kernel (use_liger_kernel, loss_implementation liger), + float8 (fsdp_8gpu_float8.yaml), float8 + compile;
 4. torch's loss kernels at a 128k vocabulary (benchmarks/chunked_loss_memory.py): whole logits, chunked, torch's
    linear_cross_entropy;
 5. LoRA, then QLoRA (bitsandbytes), on the exported 1.1B model: a few steps, adapter exported and read back;
 6. the same SFT with activation checkpointing (fsdp_8gpu_activation_checkpointing.yaml), then with per-layer
    torch.compile: the training loop only (the process is stopped once the last step is logged: step 3 checks export);
 7. a ~400M-parameter Qwen3-MoE (benchmarks/qwen3_moe_small.json) SFT: the loop only, as in 6;
 8. GRPO from the exported model, with generation_backend generate and then paged: the step-time shares; then
    each generation backend's completion tokens/s, 64 prompts x 8 at 32 and 256 new tokens
    (benchmarks/generation_backends.py).
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
            "v['linear_cross_entropy'] = hasattr(torch.nn.functional, 'linear_cross_entropy')\n"
            "print(json.dumps(v))"
        )
        code, seconds, text = self.run("versions", [sys.executable, "-c", probe], timeout=120)
        self.record("versions", json.loads(text.strip().splitlines()[-1]) if code == 0 else {"error": text})

    def estimate(self) -> None:
        for name, config in (
            ("estimate", "fsdp_8gpu.yaml"),
            ("estimate_ac", "fsdp_8gpu_activation_checkpointing.yaml"),
        ):
            command = [sys.executable, "-m", "fsdp_recipes.tools.cli", "estimate", "--model", self.model_config()]
            command += ["--accelerate-config", f"accelerate_configs/{config}", "--num-processes", "1"]
            command += ["--recipe-config", SFT_CONFIG, "--json", *self.sizes_for_estimate()]
            code, seconds, text = self.run(name, command, timeout=120)
            try:
                self.record(name, {"rc": code, **json.loads(text[text.index("{") :])})
            except ValueError:
                self.record(name, {"rc": code, "tail": text})

    def sft(self, name: str, config: str, *extra: str, steps: int, loop_only: bool = False) -> Path:
        output = self.out / name
        command = self.accelerate(
            f"accelerate_configs/{config}", "recipes/sft.py", "--config", SFT_CONFIG, "--output_dir", str(output),
            "--max_steps", str(steps), *self.sizes(), *extra,
        )  # fmt: skip
        until = (output / "metrics.jsonl", steps) if loop_only else None
        code, seconds, text = self.run(name, command, timeout=300, until_metrics=until)
        self.record(name, {"rc": code, "seconds": seconds, **training_figures(output), **failure(code, text)})
        return output

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

    def sizes_for_estimate(self) -> list[str]:
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
        for key in ("time/generation_share", "time/scoring_share", "time/training_share", "tokens/generated_per_second")
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
    steps_base, steps_variant = (6, 4) if args.dry_run else (30, 20)
    check.versions()
    if wanted("estimate"):
        check.estimate()
    base = check.out / "sft_bf16"
    if wanted("sft_bf16"):
        base = check.sft("sft_bf16", "fsdp_8gpu.yaml", steps=steps_base)
    # FlexAttention for the packed rows (what auto takes on CUDA; the check's config pins sdpa): alone and compiled.
    # On the CPU dry run flex cannot train (no backward there): the steps run with auto (sdpa) to rehearse the rest.
    flex = [] if args.dry_run else ["--attn_implementation", "flex_attention"]
    if wanted("sft_flex"):
        check.sft("sft_flex", "fsdp_8gpu.yaml", *flex, steps=steps_variant, loop_only=True)
    if wanted("sft_flex_compile"):
        check.sft("sft_flex_compile", "fsdp_8gpu.yaml", *flex, "--torch_compile", "true", steps=steps_variant,
                  loop_only=True)  # fmt: skip
    # liger-kernel's fused norms, rotary and MLP, with its fused linear cross-entropy (Triton: CUDA only)
    if wanted("sft_flex_liger") and not args.dry_run:
        check.sft("sft_flex_liger", "fsdp_8gpu.yaml", *flex, "--use_liger_kernel", "true", "--loss_implementation",
                  "liger", steps=steps_variant, loop_only=True)  # fmt: skip
    # torchao's float8 matmuls, FSDP2 gathering float8 weights (the CPU dry run needs torchao on its path)
    if wanted("sft_flex_float8") and (not args.dry_run or importlib.util.find_spec("torchao")):
        check.sft("sft_flex_float8", "fsdp_8gpu_float8.yaml", *flex, steps=steps_variant, loop_only=True)
    if wanted("sft_flex_compile_float8") and (not args.dry_run or importlib.util.find_spec("torchao")):
        check.sft("sft_flex_compile_float8", "fsdp_8gpu_float8.yaml", *flex, "--torch_compile", "true",
                  steps=steps_variant, loop_only=True)  # fmt: skip
    if wanted("loss_kernels"):
        check.loss_kernels()
    if wanted("sft_bf16_ac"):
        check.sft("sft_bf16_ac", "fsdp_8gpu_activation_checkpointing.yaml", steps=steps_variant, loop_only=True)
    if wanted("lora"):
        check.sft("lora", "fsdp_8gpu.yaml", "--model_name_or_path", str(base), "--model_config", "null",
                  "--use_peft", "true", steps=steps_variant)  # fmt: skip
    if wanted("qlora") and not args.dry_run:  # bitsandbytes' 4-bit layers need CUDA under FSDP here
        check.sft("qlora", "fsdp_8gpu.yaml", "--model_name_or_path", str(base), "--model_config", "null",
                  "--use_peft", "true", "--load_in_4bit", "true", "--bnb_4bit_compute_dtype", "bfloat16",
                  "--bnb_4bit_quant_storage", "bfloat16", steps=steps_variant)  # fmt: skip
    if wanted("grpo"):
        check.grpo(base)
    if wanted("moe"):
        check.sft("moe", "fsdp_8gpu.yaml", "--model_config", check.moe_config(), steps=steps_variant, loop_only=True)
    if wanted("sft_bf16_compile"):
        check.sft("sft_bf16_compile", "fsdp_8gpu.yaml", "--torch_compile", "true", steps=steps_variant, loop_only=True)
    check.results["seconds_left_of_budget"] = round(check.left())
    check.save()
    print(f"== done: {check.out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
