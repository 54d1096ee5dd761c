"""Run under `accelerate launch`: prepares a model from a config with AdamW exactly as the recipe does, takes one
optimizer step, and reports per rank the bytes this rank really holds (parameter shards, gradient shards, AdamW
state) next to what fsdp_recipes.memory predicts for this rank. Used by tests/test_memory.py.

    accelerate launch --config_file accelerate_configs/fsdp_2proc_cpu.yaml --num_processes N \
        tests/scripts/measure_state_bytes.py MODEL_CONFIG_JSON [REPORT_DIR]
"""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.distributed import build_accelerator
from fsdp_recipes.errors import exit_on_user_error
from fsdp_recipes.memory import estimate_for_run, topology_from_accelerator
from fsdp_recipes.config import TrainingConfig
from fsdp_recipes.training import build_optimizer


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (FSDP2 pads shards; gradients may share one buffer)."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main():
    accelerator = build_accelerator()
    config = AutoConfig.from_pretrained(sys.argv[1])
    recipe = SimpleNamespace(max_length=32, per_device_train_batch_size=2, attn_implementation="sdpa")
    predicted = estimate_for_run(accelerator, config, recipe)  # before prepare: what the recipe would do
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = build_optimizer(model, TrainingConfig(learning_rate=1e-3, weight_decay=0.01))
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (recipe.per_device_train_batch_size, recipe.max_length),
                        generator=torch.Generator().manual_seed(accelerator.process_index))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    accelerator.backward(loss)
    optimizer.step()  # gradients stay (no zero_grad): all three kinds of state exist now

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "topology": {k: v for k, v in dataclasses.asdict(topology_from_accelerator(accelerator)).items()},
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "measured": {
            "parameters": storage_bytes(params),
            "gradients": storage_bytes(grads),
            "optimizer_state": nbytes(states),
        },
        "measured_local_views": {"parameters": nbytes(params), "gradients": nbytes(grads)},
        "predicted": predicted["rank_state_bytes"],
        "predicted_per_gpu": predicted["predicted_per_gpu_bytes"],
        "sharding": predicted["sharding"],
        "parameters_total": sum(p.numel() for p in model.parameters()),
    }
    print("REPORT " + json.dumps(report), flush=True)
    if len(sys.argv) > 2:  # ranks printing at once can interleave their lines: the tests read these files instead
        Path(sys.argv[2], f"rank{accelerator.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    exit_on_user_error(main)
