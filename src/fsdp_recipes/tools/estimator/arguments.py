"""The command line of `fsdp-recipes estimate` and its defaults. Imports nothing heavy: `fsdp-recipes` builds every
subcommand's parser at start-up, and the estimate itself (torch, transformers) is imported only when it runs."""

from __future__ import annotations

import argparse

DEFAULT_GPU_MEMORY = "80GB"  # memory per GPU when neither --gpu-memory nor a config's `# GPU memory:` line says
DEFAULT_RESERVE = "10%"  # CUDA context, NCCL buffers, allocator fragmentation: not modelled, kept free


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="NAME_OR_PATH_OR_CONFIG",
        help="Hub id, model folder, or config.json (default: the recipe config's model)",
    )
    parser.add_argument("--accelerate-config", required=True, metavar="FILE", help="an Accelerate config YAML")
    parser.add_argument(
        "--recipe-config",
        metavar="FILE",
        help="recipe YAML: max_length, per_device_train_batch_size, attn_implementation, model",
    )
    parser.add_argument("--max-length", type=int, help="tokens per row (overrides the recipe config)")
    parser.add_argument("--batch-size", type=int, help="per_device_train_batch_size (overrides the recipe config)")
    parser.add_argument("--num-processes", type=int, help="override num_processes (the GLOBAL GPU count)")
    parser.add_argument(
        "--images-per-row",
        type=int,
        help="vision-language models: pictures in each row (default 1; 0 with packing, taken as text rows: give the "
        "count for packed rows with pictures), each as many tokens as its processor makes (Qwen-VL: as large as the "
        "row holds, an upper bound)",
    )
    parser.add_argument(
        "--gpu-memory", default=DEFAULT_GPU_MEMORY, help="memory per GPU: 80GB, 141GiB, 24e9 (default 80GB)"
    )
    parser.add_argument(
        "--reserve",
        default=DEFAULT_RESERVE,
        help="memory per GPU kept free for what is not modelled (CUDA context, NCCL, fragmentation): "
        "a percentage of --gpu-memory or a size (default 10%%)",
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
