"""Sequence parallelism (Ulysses, `distributed/sequence_parallel.py`): rows split by position over the ranks of an
`sp` group, an all-to-all around attention, per-token values gathered back. Checked in-process where no processes
are needed (the rules, the layout read from the Accelerate YAML, the estimator), on 2 spawned processes for the
exchange itself (per-token losses and gradients against one process, packed rows, GQA, a sliding window, a width
that `sp` does not divide), and in one 4-process launch for the recipes: SFT on 1k-token packed rows under FSDP 2 x
SP 2 with its resume on the same layout and on one process, DPO, KTO and distillation (teacher and student split
alike) under the same layout and pretraining under SP 4, each equal to one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.data import write_tiny_model_config
from helpers.launch import alongside, free_port, launch, require_success
from helpers.paths import REPO
from helpers.recipes import (
    base_recipe_values,
    read_metrics,
    recipe_config,
    run_recipe_in_process,
    run_recipe_launched_here,
)

SEQUENCE = REPO / "tests" / "scripts" / "recipes_in_sequence.py"
SP_2 = REPO / "accelerate_configs" / "fsdp2_sp2_4proc_cpu.yaml"
ONE_PROCESS_FSDP = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
LAUNCHED = {
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    "PARALLELISM_CONFIG_SP_SIZE": "2",
}


def test_what_sequence_parallelism_cannot_split_is_refused_with_its_fix():
    from transformers import LlamaConfig, Qwen3MoeConfig

    from fsdp_recipes.distributed import sequence_parallel

    assert sequence_parallel.layout_problems(LAUNCHED) == {}
    for change, words in (
        ({"PARALLELISM_CONFIG_TP_SIZE": "2"}, "does not compose with tensor or expert parallelism"),
        ({"PARALLELISM_CONFIG_EP_SIZE": "2"}, "does not compose with tensor or expert parallelism"),
        ({"PARALLELISM_CONFIG_CP_SIZE": "2"}, "choose one"),
        ({"FSDP_VERSION": "1"}, "runs with FSDP2"),
    ):
        (problem,) = sequence_parallel.layout_problems({**LAUNCHED, **change}).values()
        assert words in problem and "parallelism_config_sp_size: 1" in problem, problem
    llama = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    problems = sequence_parallel.model_problems(4, llama, attn_implementation="sdpa", recipe="sft")
    assert ["num_attention_heads (6)" in problems[0], "num_key_value_heads (2)" in problems[1]] == [True, True]
    (problem,) = sequence_parallel.model_problems(2, llama, attn_implementation="flash_attention_2", recipe="dpo")
    assert "set attn_implementation: sdpa" in problem
    (problem,) = sequence_parallel.model_problems(2, llama, attn_implementation="sdpa", recipe="grpo")
    assert "grpo is not one of them yet" in problem and "sft, pretrain, dpo, kto, distill" in problem
    moe = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, output_router_logits=True)
    (problem,) = sequence_parallel.model_problems(2, moe, attn_implementation="sdpa", recipe="sft")
    assert "router_aux_loss_coef: 0" in problem
    assert sequence_parallel.model_problems(1, moe, attn_implementation="eager", recipe="grpo") == []


def test_the_layout_and_the_estimate_of_a_sequence_parallel_launch():
    """The Accelerate YAML's `parallelism_config_sp_size`: FSDP shards over the sp ranks too, the ranks of a group
    share one batch; the estimator divides the per-token activations by sp and finds the longest row that fits."""
    from fsdp_recipes.distributed.accelerate_config import LaunchLayout
    from fsdp_recipes.tools.catalog import Catalog, model_info
    from fsdp_recipes.tools.estimator.advice import longest_row
    from fsdp_recipes.tools.estimator.formulas import activation_bytes, estimate_for_recipe
    from fsdp_recipes.tools.estimator.recipe import recipe_config as read_recipe_config
    from fsdp_recipes.tools.estimator.workload import Workload

    cpu = LaunchLayout.from_file(SP_2)
    assert (cpu.sp_size, cpu.shard_size, cpu.data_parallel_size, cpu.hsdp_replicate) == (2, 4, 2, None)
    assert "over SP 2" in cpu.describe()
    node = LaunchLayout.from_file(REPO / "accelerate_configs" / "sp8_fsdp_4x8gpu.yaml")
    assert (node.sp_size, node.shard_size, node.data_parallel_size) == (8, 32, 4)

    catalog = Catalog(REPO)
    config = catalog.find("sft/llama-3.1-70b_long_128k_sp8")
    info = model_info(catalog.model_file(config))
    recipe = read_recipe_config(config.values, script=REPO / "recipes" / "sft.py", where=config.key)
    split = catalog.estimate(config)
    whole = estimate_for_recipe(info, LaunchLayout.from_file(REPO / "accelerate_configs" / "fsdp_4x8gpu.yaml"), recipe)
    assert split.layout.sp_size == 8 and split.fits and not whole.fits  # as the shipped config's comment says
    assert longest_row(info, split) >= 131072 > 4 * longest_row(info, whole)
    work = Workload(row_length=4096, micro_batch_rows=1)
    one, two = (activation_bytes(info, work, 2, sp=sp)["per_layer"] for sp in (1, 2))
    assert one / 2 < two < one  # half the tokens, plus the all-to-all's copies, keys and values unrepeated


def _exchange_on_two_ranks(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from fsdp_recipes.distributed import sequence_parallel
    from fsdp_recipes.train.losses import TokenLoss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    models = {
        "llama": LlamaConfig(num_key_value_heads=2, **shape),
        "sliding": Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=3, max_window_layers=0,
                               layer_types=["sliding_attention"] * 2, **shape),
    }  # fmt: skip
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]])  # packed, width 11
    batch = {"input_ids": torch.randint(1, 64, (2, 11)), "position_ids": positions}
    batch["targets"] = torch.randint(0, 64, (2, 11)).masked_fill(positions == 0, -100)
    errors = {}
    for name, config in models.items():
        for implementation in ("chunked", "full_logits"):
            config._attn_implementation = "sdpa"
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(config)
            loss = TokenLoss(model, implementation, chunk_size=5)
            sequence_parallel._SHARDS = None
            expected = loss.token_losses(model, batch)
            expected.sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            sequence_parallel._SHARDS = sequence_parallel.SequenceShards(dist.group.WORLD, 2, rank)
            sequence_parallel._install_attention()
            got = loss.token_losses(model, batch)
            got.sum().backward()
            worst = 0.0
            for n, parameter in model.named_parameters():
                dist.all_reduce(parameter.grad)  # FSDP's average over the dp x sp ranks, here the 2
                worst = max(worst, float((parameter.grad / 2 - grads[n]).abs().max() / grads[n].abs().max()))
            errors[(name, implementation)] = (float((got - expected).detach().abs().max()), worst)
            sequence_parallel._SHARDS = None
    results[rank] = errors
    dist.destroy_process_group()


def _run_exchange(rank, port, queue):
    results = {}
    _exchange_on_two_ranks(rank, port, results)
    queue.put(results[rank])


def test_two_ranks_splitting_each_row_give_one_process_per_token_losses_and_gradients():
    """Each rank runs 6 of every row's 11 tokens (padded to 12: its own example, no targets); packed examples stay
    apart, GQA and a sliding window of 3 hold over the whole row; the gathered per-token losses equal one process's,
    and the gradients, averaged over the 2 ranks as FSDP does, equal its gradients."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")  # not fork: a forked pytest process can hang on the threads it inherits
    queue, port = context.Queue(), free_port()
    processes = [context.Process(target=_run_exchange, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    for errors in results:
        assert len(errors) == 4
        for case, (loss_error, gradient_error) in errors.items():
            assert loss_error < 1e-5 and gradient_error < 1e-4, (case, loss_error, gradient_error)


def _steps(output_dir: Path, keys=("loss", "grad_norm")) -> dict:
    return {(r["step"], k): r[k] for r in read_metrics(output_dir) for k in keys if r.get(k) is not None}


def _assert_same_steps(launched: Path, one: Path, what: str) -> None:
    got, expected = _steps(launched), _steps(one)
    assert got and got.keys() == expected.keys(), (what, sorted(got), sorted(expected))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key, got[key], value)


def test_sft_dpo_and_pretraining_split_by_position_equal_one_process_and_resume(
    tmp_path, chat_data, tokenizer, short_run_values
):
    sft = base_recipe_values(
        write_tiny_model_config(tmp_path / "llama.json", tokenizer), chat_data, tmp_path / "sp" / "sft",
        max_length=1023, packing=True, per_device_train_batch_size=1, max_steps=3, save_steps=2, warmup_steps=0,
        exact_match_eval_samples=0, eval_steps=None, logging_steps=1,
    )  # fmt: skip
    checkpoint = tmp_path / "sp" / "sft" / "checkpoints" / "step-00000002"
    resumed = {**sft, "output_dir": str(tmp_path / "sp" / "resumed"), "resume_from_checkpoint": str(checkpoint)}
    pretrain_model = write_tiny_model_config(tmp_path / "kv4.json", tokenizer, num_key_value_heads=4)
    pretrain = short_run_values("pretrain")
    others = {name: short_run_values(name) for name in ("dpo", "kto", "distill")}

    def values(name: str, side: str) -> dict:
        made = (pretrain if name == "pretrain" else others[name])(tmp_path / side / name)
        if name == "pretrain":  # under SP 4 (one row in 4 slices): KV heads 4; one data-parallel group, as one process
            return {**made, "model_config": str(pretrain_model)}
        if side == "one":  # FSDP 2 x SP 2 runs 2 data-parallel groups: one process takes both groups' rows
            made["per_device_train_batch_size"] *= 2
        return made

    sp_4 = "@PARALLELISM_CONFIG_SP_SIZE=4,PARALLELISM_CONFIG_DP_SHARD_SIZE=1"
    runs = [("sft", sft), ("sft", resumed)] + [(name, values(name, "sp")) for name in (*others, "pretrain")]
    arguments = []
    for index, (recipe, run_values) in enumerate(runs):
        layout = sp_4 if recipe == "pretrain" else ""
        arguments += [recipe + layout, str(recipe_config(tmp_path / f"{index}.yaml", **run_values))]

    def one_process() -> None:
        one_sft = {**sft, "per_device_train_batch_size": 2, "output_dir": str(tmp_path / "one" / "sft")}
        run_recipe_in_process("sft", tmp_path, "one_sft", one_sft)
        for name in (*others, "pretrain"):
            run_recipe_in_process(name, tmp_path, f"one_{name}", values(name, "one"))

    _, (result,) = alongside(one_process, lambda: launch(SEQUENCE, arguments, num_processes=4, accelerate_config=SP_2))
    require_success(result)
    for name in ("sft", "dpo", "kto", "distill", "pretrain"):
        _assert_same_steps(tmp_path / "sp" / name, tmp_path / "one" / name, name)
    summary = json.loads((tmp_path / "sp" / "sft" / "run_summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_batch_rows"] == 2
    assert summary["sequence_parallel"]["size"] == 2 and summary["sequence_parallel"]["data_parallel_size"] == 2
    assert summary["parameter_meshes"] == ["('dp_shard_cp',)"]  # FSDP shards over the sp ranks too
    # resumed on the same layout: step 3 as the uninterrupted run had it, and the same export, bitwise
    assert _steps(tmp_path / "sp" / "resumed")[(3, "loss")] == _steps(tmp_path / "sp" / "sft")[(3, "loss")]
    exported = load_file(tmp_path / "sp" / "sft" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "sp" / "resumed" / "model.safetensors").items():
        assert torch.equal(tensor, exported[name]), name
    # resumed on one process: DCP reshards the checkpoint of the dp_shard x sp mesh
    on_one = {**resumed, "output_dir": str(tmp_path / "resumed_on_one"), "per_device_train_batch_size": 2}
    run_recipe_launched_here("sft", tmp_path, "resumed_on_one", on_one, ONE_PROCESS_FSDP)
    assert _steps(tmp_path / "resumed_on_one")[(3, "loss")] == pytest.approx(
        _steps(tmp_path / "sp" / "sft")[(3, "loss")], rel=1e-5
    )
