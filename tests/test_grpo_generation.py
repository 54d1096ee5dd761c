"""GRPO's generation pass under FSDP2 (recipes/grpo.py's `generation.weights_gathered`), on 2 real processes over gloo:
the whole weights are gathered once when the pass starts, no all-gather happens while it decodes, the completions
equal those of per-forward gathering, and afterwards the units are sharded again and gather per forward as before.
The paged and static_compiled backends run on the gathered weights with no collective at all: each rank's engine
decodes on its own (rank 1 is given fewer prompts than rank 0, and neither waits), with the same completions.
(On one process FSDP2 gathers nothing at all, so this needs two.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

PROMPTS = [[1, 5, 6, 7], [1, 9, 8], [1, 12, 13, 14, 15], [1, 20]]
NEW_TOKENS = 5


def _count_all_gathers(model, counter: list[int]) -> int:
    """Make every FSDP2 unit of `model` count its all-gathers in `counter`; returns the number of units."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Counting(DefaultAllGather):
        def __call__(self, *args, **kwargs):
            counter[0] += 1
            return super().__call__(*args, **kwargs)

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(Counting())
    return len(units)


def _generation_worker(rank: int, model_dir: str, port: int, out_dir: str) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.train import generation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        counter = [0]
        units = _count_all_gathers(model, counter)
        settings = generation.GenerationSettings(NEW_TOKENS, batch_size=len(PROMPTS), seed=3)
        keys = list(range(len(PROMPTS)))
        report = {"units": units}
        for gathered in (True, False):
            counter[0] = 0
            with generation.weights_gathered(model, enabled=gathered, reshard_after_forward=True):
                on_entry = counter[0]
                completions, _ = generation.generate_completions(
                    model, tokenizer, PROMPTS, keys, settings, synced_gpus=True
                )
                report[f"gathered={gathered}"] = {
                    "on_entry": on_entry,
                    "while_decoding": counter[0] - on_entry,
                    "completions": completions,
                }
        mine = PROMPTS if rank == 0 else PROMPTS[:2]
        for backend in ("paged", "static_compiled"):
            counter[0] = 0
            with generation.weights_gathered(model, enabled=True, reshard_after_forward=True):
                on_entry = counter[0]
                engine = dataclasses.replace(settings, backend=backend, compile_backend="eager")
                completions, _ = generation.generate_completions(
                    model, tokenizer, mine, keys[: len(mine)], engine, synced_gpus=False
                )
                report[backend] = {"while_decoding": counter[0] - on_entry, "completions": completions}
        counter[0] = 0
        with torch.no_grad():
            model(input_ids=torch.tensor([PROMPTS[0]]))
        report["one_forward_after"] = counter[0]
        local = model.model.layers[0].self_attn.q_proj.weight.to_local()
        report["sharded_rows_after"] = local.shape[0]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_generation_pass_gathers_the_weights_once_and_never_while_decoding(pretrained_tiny_model, tmp_path):
    import socket

    import torch.multiprocessing as mp
    from transformers import AutoConfig

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _generation_worker, args=(str(pretrained_tiny_model), port, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    hidden = AutoConfig.from_pretrained(pretrained_tiny_model).hidden_size
    for report in reports:
        units, once, per_forward = report["units"], report["gathered=True"], report["gathered=False"]
        assert once["on_entry"] == units and once["while_decoding"] == 0
        assert per_forward["on_entry"] == 0 and per_forward["while_decoding"] >= NEW_TOKENS * units
        assert once["completions"] == per_forward["completions"]
        for backend in ("paged", "static_compiled"):
            assert report[backend]["while_decoding"] == 0
            assert report[backend]["completions"] == once["completions"][: len(report[backend]["completions"])]
        assert report["one_forward_after"] == units  # sharded again: each unit gathers for a forward, as before
        assert report["sharded_rows_after"] == hidden // 2
    assert reports[0]["gathered=True"]["completions"] == reports[1]["gathered=True"]["completions"]
