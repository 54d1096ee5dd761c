"""Run under `accelerate launch`: builds the recipe's accelerator, prepares a tiny model and reports, per rank, how
its parameters are placed. Used by tests/test_distributed.py."""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.distributed import build_accelerator, local_and_total_parameters
from fsdp_recipes.errors import exit_on_user_error


def main():
    accelerator = build_accelerator()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    placements = sorted({str(getattr(p, "placements", "plain tensor")) for p in model.parameters()})
    local, total = local_and_total_parameters(model)
    report = {
        "rank": accelerator.process_index,
        "distributed_type": accelerator.distributed_type.value,
        "placements": placements,
        "local": local,
        "total": total,
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
