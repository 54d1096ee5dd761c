"""FSDP-aware memory estimate per GPU, from a model config and an Accelerate YAML, before anything is launched.

`fsdp-recipes estimate --model NAME_OR_PATH_OR_CONFIG --accelerate-config FILE [--recipe-config FILE]` (or
`python -m fsdp_recipes.tools.estimator ...`) builds the model on the meta device (no weights, no GPU, no network for
a local config), splits its parameters into the FSDP units that accelerate's preparation would create, and adds up,
for the most loaded rank:

- parameters, gradients and AdamW state as sharded by the config (FSDP2: every parameter split along dim 0, a rank
  holding ceil(rows / shard_size) rows; FSDP1: one flat parameter per unit padded to a multiple of the shard size);
- activations of one micro-batch (the recipe's rows per micro-step x tokens per row), with and without activation
  checkpointing, and the fp32 logits of the loss;
- FSDP's unsharded buffers (all-gathered parameters of the units in use and prefetched, in the compute dtype, and the
  unsharded gradients of a unit before its reduce-scatter).

What a run does is asked of its recipe's config (a `TrainingConfig`: its row length, rows per micro-step, frozen
model copies, memory-saving alternatives); the launch is a `LaunchLayout` (fsdp_recipes.distributed.accelerate_config).

Modules, bottom up: `shapes` (a model's shapes, from a config on the meta device), `workload` (what a recipe config
runs: rows, tokens, LoRA adapters), `formulas` (FSDP units, the bytes of each kind, `Estimate`), `advice` (what to
change when it does not fit), `report` (the JSON object and the text), `recipe` (a recipe config from YAML, read
with its recipe's own class), `arguments` and `command` (the command line), `live` (`estimate_for_run`, the
prediction a running recipe writes beside what it measures).

The formulas are in docs/memory-estimator.md; tests/test_memory.py checks the state bytes against what real FSDP2
ranks hold on CPU at 1, 2 and 4 processes.
"""

from pathlib import Path

# <hub id>/config.json: the published shapes of the Hub models the shipped configs name, so that `fsdp-recipes ls`
# estimates them offline (package data: a built wheel carries them).
MODEL_SHAPES = Path(__file__).resolve().parent / "model_shapes"
