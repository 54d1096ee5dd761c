"""The shared layer under FSDP Recipes' recipes: config, distributed set-up (FSDP2 on GPUs and on CPU), data,
model loading, training-loop pieces, checkpoints, export, Hub push and metrics. Recipes import from here; nothing
here knows about a particular recipe."""

__version__ = "0.1.0"
