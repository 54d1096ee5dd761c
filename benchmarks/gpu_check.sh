#!/usr/bin/env bash
# One prepared GPU check: SFT of a 1.1B-parameter Llama under FSDP2 in bf16 on ONE GPU for a few minutes at most,
# then tokens/s, MFU and peak memory from the run beside the memory estimator's prediction.
#   bash benchmarks/gpu_check.sh            (on a machine with a CUDA GPU and this repo's requirements installed)
# Uses the packages already installed (python3 on PATH, or PYTHON=...); the repo is put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${GPU_CHECK_OUTPUT:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name())"

if "$PYTHON" -c "import fsdp_recipes.tools.estimator.command" 2>/dev/null; then
  echo "== estimator prediction (per GPU)"
  "$PYTHON" -m fsdp_recipes.tools.cli estimate --model benchmarks/llama_1b.json \
    --accelerate-config accelerate_configs/fsdp_8gpu.yaml --num-processes 1 \
    --recipe-config recipes/configs/sft/gpu_check_1b.yaml --json | tee "$OUT.estimate.json" || true
fi

echo "== training"
timeout 540 "$PYTHON" -m accelerate.commands.launch --config_file accelerate_configs/fsdp_8gpu.yaml --num_processes 1 \
  recipes/sft.py --config recipes/configs/sft/gpu_check_1b.yaml --output_dir "$OUT"

echo "== measured (means over logging windows after the first)"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
records = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in l][1:]
mean = lambda key: sum(r[key] for r in records) / len(records)
print(json.dumps({
    "tokens_per_second_per_device": round(mean("tokens_per_second_per_device")),
    "mfu": round(mean("mfu"), 4) if records[0]["mfu"] is not None else None,
    "step_time_s": round(mean("step_time_s"), 3),
    "peak_memory_gib": max(max(r["peak_memory_gib_per_rank"]) for r in records),
    "padding_fraction": round(mean("padding_fraction"), 4),
}, indent=2))
PY

echo "== loss memory: whole logits vs chunked cross-entropy (benchmarks/chunked_loss_memory.py, on the GPU)"
timeout 300 "$PYTHON" benchmarks/chunked_loss_memory.py --device cuda --hidden 2048 --rows 8 || true
