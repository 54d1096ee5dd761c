#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for benchmarks/gpu_check.sh (docs/gpu.md): downloaded here into .whl/, at the
# versions this repo pins, for the machine's Python 3.12 on x86_64. That machine has torch 2.11 + CUDA, triton, numpy,
# pandas, pyarrow, xxhash, psutil, jinja2... and reaches no package index, so what it lacks travels with the working
# tree (the device tool's `carry`, 64 MiB in all with the tree itself).
#   bash benchmarks/gpu_wheels.sh            # then, on the machine, before the check:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# bitsandbytes (43 MB) does not fit beside the rest, so the check's QLoRA step is skipped (measured on 4 December).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# the packages our code and TRL import, beyond the machine's image (KINDS.md lists the image's packages)
NAMES="accelerate transformers datasets tokenizers safetensors huggingface_hub evaluate peft dill multiprocess regex
fsspec torchao liger-kernel"
TRL_VERSION=${TRL_VERSION:-1.16.0}  # the TRL that benchmarks/grpo_vs_trl.py was measured against
pin() {  # NAME -> NAME==VERSION from the requirement files, or from the venv for a package pulled in indirectly
    local line
    line=$(grep -ihE "^$1==" requirements.txt requirements-gpu.txt requirements-qlora.txt | head -1 | cut -d' ' -f1)
    if [ -z "$line" ]; then
        line="$1==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))")"
    fi
    echo "$line"
}
wanted=()
for name in $NAMES; do wanted+=("$(pin "$name")"); done
wanted+=("trl==$TRL_VERSION")
rm -rf .whl && mkdir .whl
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${wanted[@]}"
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$(ls .whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in .whl/ (carry .whl: 64 MiB in all, tree included)"
if [ "$total" -gt $((56 * 1024 * 1024)) ]; then
    echo "error: .whl/ holds more than 56 MiB, which leaves too little of the 64 MiB for the tree; drop a wheel" >&2
    exit 1
fi
