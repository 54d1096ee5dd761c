"""The shipped Accelerate configs rehearsed on this CPU machine with the SFT recipe, under real `accelerate launch`.

HSDP (hsdp_4proc_cpu.yaml) really builds a 2 x 2 (replicate x shard) mesh, and HSDP, SHARD_GRAD_OP and NO_SHARD
(plain DDP, MULTI_GPU: MULTI_CPU here) all give the losses of the 2-process FULL_SHARD run with the same global
batch (the shared reference run of tests/fixtures/sft.py). The SLURM template, run as SLURM would run it on two
nodes, gives 2 nodes x 2 processes of HSDP the losses of 1 node x 4. SHARD_GRAD_OP runs as shipped, in bf16, within
bf16's rounding of the fp32 run (every config's settings on one rank: tests/test_precision_rehearsal.py).
A wrap class the model lacks stops the recipe before any weights load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fixtures.sft import STEPS, resume_values, run_sft
from helpers.launch import ACCELERATE, LAUNCH_TIMEOUT_S, concurrently, free_port, require_success, run_process_group
from helpers.paths import REPO
from helpers.recipes import read_metrics, recipe_config

pytestmark = pytest.mark.slow
CONFIGS = REPO / "accelerate_configs"
GPU_CONFIG_ON_CPU = ["--mixed_precision", "no"]  # a GPU config rehearsed in fp32, for exact comparisons


def run_recipe(
    tmp: Path,
    name: str,
    config: Path,
    *,
    num_processes: int,
    rows_per_process: int,
    tiny_model_config,
    data,
    launcher_args=(),
    exact_match_eval_samples: int = 0,
) -> Path:
    values = resume_values(
        tiny_model_config,
        data,
        tmp / name,
        per_device_train_batch_size=rows_per_process,
        save_steps=None,
        exact_match_eval_samples=exact_match_eval_samples,
    )
    run_sft(tmp, name, values, num_processes=num_processes, accelerate_config=config, launcher_args=list(launcher_args))
    return tmp / name


# Stand-ins for SLURM on one machine: srun starts its command once per node with that node's SLURM_NODEID (as the
# real one does with --ntasks-per-node=1) and, like --kill-on-bad-exit, stops the others when one fails; scontrol
# names this machine as the first node; accelerate records the command line each node's launcher got, then runs.
# On real nodes only node 0 binds the rendezvous port; here every launcher is on 127.0.0.1, so the other nodes start
# once node 0 listens (launched together, node 0's launcher can find the port taken and refuse to start).
FAKE_SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
SLURM_NODEID=0 "$@" & pids=($!)
for _ in $(seq 1500); do (exec 3<>/dev/tcp/127.0.0.1/$MAIN_PORT) 2>/dev/null && break; sleep 0.2; done
for ((node = 1; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for _ in "${pids[@]}"; do wait -n || { status=$?; kill "${pids[@]}" 2>/dev/null; }; done
exit $status
"""
FAKE_SCONTROL = "#!/bin/bash\necho 127.0.0.1\n"
RECORDING_ACCELERATE = '#!/bin/bash\necho "$*" >> "$LAUNCHES"\nexec {accelerate} "$@"\n'


def run_on_two_slurm_nodes(tmp: Path, tiny_model_config, data) -> Path:
    """The SLURM template with the environment SLURM gives each of 2 nodes of 2 CPU processes: HSDP 2 x 2, one
    replica per node. The launch line each node's launcher got is recorded next to the output folder."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in [
        ("srun", FAKE_SRUN),
        ("scontrol", FAKE_SCONTROL),
        ("accelerate", RECORDING_ACCELERATE.format(accelerate=ACCELERATE)),
    ]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    values = resume_values(
        tiny_model_config, data, tmp / "out", per_device_train_batch_size=2, save_steps=None, exact_match_eval_samples=0
    )
    slurm = {
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "GPUS_PER_NODE": "2",
        "MAIN_PORT": str(free_port()),
        "LAUNCHES": str(tmp / "launches.txt"),
    }
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        "bash",
        str(CONFIGS / "slurm_multinode.sbatch"),
        str(CONFIGS / "hsdp_4proc_cpu.yaml"),
        "recipes/sft.py",
        "--config",
        str(recipe_config(tmp / "two_nodes.yaml", **values)),
    ]
    require_success(run_process_group(command, timeout=LAUNCH_TIMEOUT_S, env=env))
    return tmp / "out"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_config, small_chat_data, reference_run):
    """The reference run's 12 steps (global batch 16 rows, fp32) on the other topologies."""
    tmp = tmp_path_factory.mktemp("topology_runs")
    common = dict(tiny_model_config=tiny_model_config, data=small_chat_data)
    two_nodes = tmp_path_factory.mktemp("two_nodes")
    hsdp, shard_grad_op, no_shard = concurrently(  # independent launches, side by side
        # HSDP 2 x 2, rehearsed as two "nodes" through the SLURM template (4 processes in all)
        lambda: run_on_two_slurm_nodes(two_nodes, tiny_model_config, small_chat_data),
        # as shipped, in bf16: also the 2-rank run of a GPU config's mixed precision (the rest are fp32, exact)
        lambda: run_recipe(
            tmp,
            "shard_grad_op",
            CONFIGS / "fsdp_8gpu_shard_grad_op.yaml",
            num_processes=2,
            rows_per_process=4,
            **common,
        ),
        lambda: run_recipe(
            tmp,
            "no_shard",
            CONFIGS / "ddp_8gpu.yaml",
            num_processes=2,
            rows_per_process=4,
            launcher_args=GPU_CONFIG_ON_CPU,
            exact_match_eval_samples=4,  # DDP wraps the model, which has no `generate` of its own then
            **common,
        ),
    )
    return {"full_shard": reference_run, "hsdp": hsdp, "shard_grad_op": shard_grad_op, "no_shard": no_shard}


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "run_summary.json").read_text())


# bf16 (SHARD_GRAD_OP's config as shipped) moved the losses by at most 0.014% over 12 steps; checked to 0.2%
@pytest.mark.parametrize("name, rtol", [("hsdp", 1e-5), ("shard_grad_op", 2e-3), ("no_shard", 1e-5)])
def test_losses_equal_the_two_process_full_shard_run(runs, name, rtol):
    reference, other = losses(runs["full_shard"]), losses(runs[name])
    assert len(reference) == len(other) == STEPS
    assert reference[-1] < reference[0]  # it trains
    atol = 1e-6 if rtol < 1e-4 else 0.0
    torch.testing.assert_close(torch.tensor(other), torch.tensor(reference), rtol=rtol, atol=atol)


def test_a_shipped_bf16_config_on_two_ranks_trains_with_the_default_loss_and_exports(runs):
    """The GPU configs' bf16 with the default chunked loss: its first step once crashed on every rank. The export is
    read back by the run itself (every config's settings on one rank: tests/test_precision_rehearsal.py)."""
    sgo = summary(runs["shard_grad_op"])
    assert (sgo["mixed_precision"], sgo["world_size"]) == ("bf16", 2) and sgo["loss"].startswith("chunked")
    assert (runs["shard_grad_op"] / "model.safetensors").exists()


def test_each_run_used_the_topology_its_config_names(runs):
    hsdp, sgo, ddp = summary(runs["hsdp"]), summary(runs["shard_grad_op"]), summary(runs["no_shard"])
    assert (hsdp["world_size"], hsdp["distributed_type"], hsdp["fsdp"]["reshard_after_forward"]) == (4, "FSDP", "True")
    # HSDP: each parameter is split in 2 shards, so each of the 4 ranks holds about half of the model.
    assert sum(hsdp["parameters_per_rank"]) == 2 * hsdp["parameters_total"]
    assert (sgo["world_size"], sgo["distributed_type"], sgo["fsdp"]["reshard_after_forward"]) == (2, "FSDP", "False")
    assert (ddp["world_size"], ddp["distributed_type"], ddp["fsdp"]) == (2, "MULTI_CPU", None)
    assert ddp["parameters_per_rank"] == [ddp["parameters_total"]] * 2  # DDP: every rank holds the whole model
    results = json.loads((runs["no_shard"] / "eval_results.json").read_text())  # its module generated, under DDP
    assert {"exact_match_before", "exact_match_after"} <= set(results)


def test_hsdp_config_on_four_cpu_processes_builds_a_replicate_by_shard_mesh(runs):
    hsdp = summary(runs["hsdp"])
    assert hsdp["parameter_placements"] == ["(Replicate(), Shard(dim=0))"]
    # Ranks 0-1 and 2-3 are the two replicas: each pair holds the whole model between them.
    per_rank = hsdp["parameters_per_rank"]
    assert per_rank[0] + per_rank[1] == hsdp["parameters_total"] and per_rank[:2] == per_rank[2:]
    # What each of the 4 ranks holds is predicted to the byte: shards of 2, so ranks 0/2 and 1/3 alike, 0 and 1 not.
    held = hsdp["state_bytes_per_rank"]
    assert held == hsdp["memory_estimate"]["rank_state_bytes_per_rank"]
    assert held[0] == held[2] and held[1] == held[3] and held[0] != held[1]


def test_slurm_template_on_two_nodes_launches_each_node_as_slurm_would(runs):
    """accelerate_configs/slurm_multinode.sbatch itself ran the HSDP run of `runs`: 2 nodes of 2 CPU processes (one
    replica per node) over loopback with c10d rendezvous; its losses equal the 1-node FULL_SHARD run's (above)."""
    per_node = sorted((runs["hsdp"].parent / "launches.txt").read_text().splitlines())
    assert len(per_node) == 2
    for rank, line in enumerate(per_node):
        assert f"--num_machines 2 --num_processes 4 --machine_rank {rank} --main_process_ip 127.0.0.1" in line
        assert "--rdzv_backend c10d recipes/sft.py --config" in line


def test_slurm_template_refuses_a_missing_recipe_script():
    result = run_process_group(
        [
            "bash",
            str(CONFIGS / "slurm_multinode.sbatch"),
            str(CONFIGS / "fsdp_2x8gpu.yaml"),
            "--config",
            "recipes/configs/sft/demo_reverse.yaml",
        ],
        timeout=30,
    )
    assert result.returncode == 2
    assert "RECIPE_SCRIPT is '--config', not a recipe file here" in result.stderr


def test_slurm_template_passes_a_preemption_notice_to_the_launchers_and_requeues_the_job(tmp_path):
    """SLURM's notice (USR1 to the batch script, --signal=B:USR1@180) becomes SIGTERM to srun, which passes it on to
    the launchers and their ranks (the 2-process preemption test: tests/test_checkpoint_resume.py); once srun is done
    the job is requeued. Stand-ins record what srun and scontrol were told."""
    import signal
    import subprocess
    import time

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\ntrap \'kill "$child"; echo "srun: TERM" >> {log}; exit 75\' TERM\n'
        f'sleep 60 & child=$!\necho "srun: started" >> {log}\nwait\n'
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\n[[ $1 == requeue ]] && echo "scontrol: $*" >> {log}\necho 127.0.0.1\n'
    )
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node0"}
    environment.update(SLURM_NNODES="1", SLURM_JOB_ID="42")
    job = subprocess.Popen(
        ["bash", str(CONFIGS / "slurm_multinode.sbatch"), str(CONFIGS / "fsdp_8gpu.yaml"), "recipes/sft.py"],
        cwd=REPO, env=environment, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for _ in range(100):
        if log.exists():
            break
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)
    _, stderr = job.communicate(timeout=30)
    assert log.read_text().splitlines() == ["srun: started", "srun: TERM", "scontrol: requeue 42"]
    assert job.returncode == 0 and "preempted: requeueing job 42" in stderr


def test_a_wrap_class_the_model_lacks_stops_the_recipe_before_weights_load(tiny_model_config):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from transformers import AutoConfig

    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.models.modeling import resolve_wrap_classes

    plugin = SimpleNamespace(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(ConfigError, match="fsdp_transformer_layer_cls_to_wrap names GPT2Block") as error:
        resolve_wrap_classes(accelerator, AutoConfig.from_pretrained(tiny_model_config))
    assert "Set it to LlamaDecoderLayer" in str(error.value)
    plugin.transformer_cls_names_to_wrap = None  # then the model's own _no_split_modules
    assert resolve_wrap_classes(accelerator, AutoConfig.from_pretrained(tiny_model_config)) == ["LlamaDecoderLayer"]
