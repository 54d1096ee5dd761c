"""FSDP alone through the two routes this repository knows, on the same batches: accelerate's FSDP2 preparation (what
FSDP-only Accelerate configs use) and transformers' DistributedConfig (what tensor-parallel configs use, here with
tp_size 1), against one process. Why FSDP-only layouts stay on accelerate's route: docs/parallelism.md.

    python benchmarks/fsdp_routes.py            # launches itself: 2 CPU processes (gloo), then 1 process

A 0.1M-parameter Llama saved to a temporary folder; 5 AdamW steps (lr 1e-2) on one fixed global batch of 8 rows of 32
tokens, each rank its half; the loss is the model's own (labels = inputs). Prints the losses of each route and the
largest relative difference from one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STEPS = 5


def make_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)


def batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (8, 32), generator=generator)


def train(model, optimizer, rows: torch.Tensor, backward) -> list[float]:
    import torch.distributed as dist

    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=rows, labels=rows).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def run_launched(folder: str) -> None:
    """Both routes, one after the other, in this launch's processes."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from fsdp_recipes.distributed.accelerator import build_accelerator

    accelerator, _parallel = build_accelerator()  # accelerate's FSDP2 over gloo (fsdp_recipes.distributed.accelerator)
    rank, world = accelerator.process_index, accelerator.num_processes
    rows = batch().chunk(world)[rank]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    by_accelerate = train(model, optimizer, rows, accelerator.backward)

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=1, fsdp_size=world)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    by_transformers = train(model, optimizer, rows, lambda loss: loss.backward())
    if dist.get_rank() == 0:
        print(json.dumps({"accelerate FSDP2": by_accelerate, "transformers DistributedConfig": by_transformers}))


def main() -> None:
    if len(sys.argv) > 1:
        return run_launched(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        one = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch(), lambda loss: loss.backward())
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"), __file__, tmp,
        ]  # fmt: skip
        output = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
        if output.returncode or not lines:
            sys.exit(f"the launch failed:\n{output.stderr[-3000:]}")
        routes = json.loads(lines[-1])
    print(f"{'1 process':46} {' '.join(f'{v:.7f}' for v in one)}")
    for name, losses in routes.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, one))
        print(f"{name + ', 2 processes':46} {' '.join(f'{v:.7f}' for v in losses)}  (max rel. diff {worst:.1e})")


if __name__ == "__main__":
    main()
