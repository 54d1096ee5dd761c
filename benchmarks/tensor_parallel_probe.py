"""Does FSDP2 x tensor parallelism run through accelerate with the installed versions? The smallest check, on CPU.

    python benchmarks/tensor_parallel_probe.py          # launches itself: 4 CPU processes, dp_shard 2 x tp 2

It does what accelerate's examples/torch_native_parallelism/nd_parallel.py does, on a 0.1M-parameter Llama saved to
a temporary folder: the Accelerator from an Accelerate YAML with a parallelism_config block (through
fsdp_recipes.distributed.accelerator, which joins CPU processes over gloo), `from_pretrained(tp_plan="auto",
device_mesh=accelerator.torch_device_mesh["tp"])`, then `accelerator.prepare(model, optimizer)`, which applies FSDP2
over the data-parallel dimension. Each rank prints one line per stage: the TP degree the model was really sharded with
(q_proj's rows on this rank against the whole), then prepare's outcome. With accelerate 1.15 and transformers 5.24
(run 2026-12-03) every rank prints

    loaded: q_proj holds 16 of 64 rows (TP 4, the mesh's tp dimension is 2)
    prepare failed: ImportError: cannot import name 'ReplicateParallel' from 'transformers.integrations.tensor_parallel'

which is why fsdp_recipes.distributed.parallel_dims refuses tp_size > 1 (docs/parallelism.md). Rerun it after
upgrading accelerate or transformers: TP can be wired into the recipes once it prints `prepare: ok` with TP 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCH_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "mixed_precision": "no",
    "num_processes": 4,
    "num_machines": 1,
    "machine_rank": 0,
    "use_cpu": False,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_reshard_after_forward": True,
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_sync_module_states": False,
    },
    "parallelism_config": {
        "parallelism_config_dp_replicate_size": 1,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
    },
}


def launch() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        model_config = LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        LlamaForCausalLM(model_config).save_pretrained(f"{folder}/model")
        Path(f"{folder}/accelerate.yaml").write_text(yaml.safe_dump(LAUNCH_CONFIG))
        environment = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"{folder}/accelerate.yaml"]
        return subprocess.call([*command, __file__, f"{folder}/model"], env=environment)


def probe(model_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.distributed.accelerator import build_accelerator

    accelerator = build_accelerator()
    mesh = accelerator.torch_device_mesh
    rank = accelerator.process_index
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, tp_plan="auto", device_mesh=mesh["tp"]
    )
    weight = model.model.layers[0].self_attn.q_proj.weight
    rows, total = weight.to_local().shape[0], weight.shape[0]
    print(
        f"rank {rank} loaded: q_proj holds {rows} of {total} rows (TP {total // rows}, the mesh's tp dimension is "
        f"{mesh['tp'].size()})",
        flush=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        accelerator.prepare(model, optimizer)
    except Exception as error:  # noqa: BLE001 - the outcome is what this probe reports
        print(f"rank {rank} prepare failed: {type(error).__name__}: {error}", flush=True)
        return
    print(f"rank {rank} prepare: ok", flush=True)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        probe(sys.argv[1])
    else:
        sys.exit(launch())
