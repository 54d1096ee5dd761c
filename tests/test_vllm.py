"""Generation through vLLM (docs/vllm.md): one real server on loopback (tests/fixtures/vllm.py) serves every test here,
in file order: the serve command's and the configs' refusals; the server's greedy completions and log-probabilities
against the trainer's; weights pushed (full and LoRA-merged) and the completions that follow them; a mixture of experts
through vLLM's own engine; eval and on-policy distillation through the server; asynchronous rounds and their exact
resume; 2-process FSDP2 GRPO learning through it (full and LoRA); and last, the server killed mid-run: every rank stops
with one error line, the checkpoint is kept, and once the server is back the same command resumes exactly (a
mixture of experts through vLLM's own engine runs while the server starts again)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from fixtures.vllm import VLLM_PYTHON, Server, require_vllm_environment, vllm_extension_folder, vllm_grpo_values
from helpers.launch import run_launched
from helpers.paths import REPO
from helpers.recipes import read_metrics, recipe_error_in_process, run_recipe_in_process

pytestmark = pytest.mark.slow  # a vLLM server, and launches: `make test-fast` leaves the module out
GRPO = REPO / "recipes" / "grpo.py"
EVAL = REPO / "recipes" / "eval.py"


def step_records(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


def completions_of(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]


def connect(server: Server, model_name: str = "m"):
    from fsdp_recipes.train.vllm_client import VLLMServer

    connected = VLLMServer.connect(server.url, wait=5, request_timeout=60, model_name=model_name)
    connected.claim()  # this test's: a run's weights pushed earlier are replaced
    return connected


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy(model, tokenizer, prompts, server=None, max_tokens: int = 8) -> list[list[int]]:
    from fsdp_recipes.train import generation

    backend = dict(backend="vllm", server=server) if server is not None else {}
    settings = generation.GenerationSettings(max_tokens, greedy=True, block_eos_first=False, **backend)
    return generation.generate_completions(
        model, tokenizer, prompts, list(range(len(prompts))), settings, synced_gpus=False
    )[0]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["reverse: abc", "reverse: hello world", "x", "the quick brown fox"]
    return [tokenizer(text)["input_ids"] for text in texts]


def test_the_serve_command_refuses_what_cannot_start_with_one_error_line(vllm_server, tmp_path, capsys):
    from fsdp_recipes.tools import cli

    cases = [
        (["--model", str(tmp_path / "none")], "no model folder there"),
        (["--model", str(vllm_server.model), "--tensor-parallel-size", "64"], "this machine has"),
        (["--model", str(vllm_server.model), "--max-model-len", "4096"], "more than the model's 256 positions"),
        (["--model", str(vllm_server.model), "--port", str(vllm_server.port)], "is in use"),
        (["--model", str(vllm_server.model), "--vllm-python", str(tmp_path / "python")], "no vLLM environment found"),
    ]
    for arguments, words in cases:
        assert cli.main(["vllm-serve", *arguments]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and words in errors[0], (arguments, errors)
    assert cli.main(["vllm-serve", "--model", str(vllm_server.model), "--dry-run"]) == 0
    printed = capsys.readouterr().err
    for part in ("VLLM_SERVER_DEV_MODE=1", "--logprobs-mode processed_logprobs", "--worker-extension-cls"):
        assert part in printed


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"vllm_mode": "colocated"}, "vllm_mode 'colocated' is not one of"),
        ({"vllm_mode": "colocate"}, "vllm_mode colocate runs vLLM inside each training process"),
        ({"async_generation": True, "max_staleness": 0}, "max_staleness must be >= 1"),
        ({"async_generation": True, "use_vllm": False}, "async_generation writes the next round on the vLLM server"),
        ({"async_generation": True, "dynamic_sampling": True}, "async_generation with dynamic_sampling"),
        ({"vllm_importance_sampling_mode": "token_clip"}, "vllm_importance_sampling_mode 'token_clip' is not one of"),
        ({"vllm_tensor_parallel_size": 2}, "runs tensor parallel 1"),
        ({"max_length": 240, "max_completion_length": 8}, "takes at most 200 tokens per request"),
        ({"vllm_server_base_url": "FREE_PORT", "vllm_server_timeout": 1}, "no vLLM server answers at"),
        ({"model_name_or_path": "OTHER_MODEL"}, "serves another model"),
    ],
)
def test_bad_vllm_settings_are_refused_before_weights_load(
    vllm_server, vllm_prompts, pretrained_tiny_model, tmp_path, capsys, overrides, words
):
    from helpers.launch import free_port

    if overrides.get("vllm_server_base_url") == "FREE_PORT":
        overrides["vllm_server_base_url"] = f"http://127.0.0.1:{free_port()}"
    if overrides.get("model_name_or_path") == "OTHER_MODEL":  # 4 heads of 16 where the server holds 2 of 32
        overrides["model_name_or_path"] = str(pretrained_tiny_model)
    values = vllm_grpo_values(vllm_server.model, vllm_prompts, tmp_path / "out", vllm_server, **overrides)
    error = recipe_error_in_process("grpo", tmp_path, values, capsys)
    assert words in error
    assert not (tmp_path / "out").exists()


def test_greedy_completions_and_log_probabilities_are_the_trainers(vllm_server, vllm_prompts, tokenizer, prompts):
    """A round of 256 seeded completions at once (vLLM's CPU engine died on it with chunked prefill, which
    `vllm-serve` turns off); fp32 on both sides: the same greedy tokens as transformers' generate, and each sampled
    token's log-probability within 1e-4 of the trainer's; a completion's first token, where the end of sequence is blocked (min_tokens 1),
    is the trainer's renormalised without the stop tokens, as vLLM samples it."""
    server = connect(vllm_server)
    model = load(vllm_server.model)
    server.load_weights(str(vllm_server.model))  # whatever an earlier test pushed: the folder's own weights
    assert greedy(model, tokenizer, prompts, server) == greedy(model, tokenizer, prompts)
    stops = [tokenizer.eos_token_id]
    rows = [json.loads(line) for line in (vllm_prompts / "train.jsonl").read_text().splitlines()[:32]]
    chats = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"] for row in rows]
    many = [chat for chat in chats for _ in range(8)]  # 256 completions, ~4,800 prompt tokens: a GRPO demo round
    sampled = server.generate(
        many, [p * 100 + g for p in range(32) for g in range(8)], seed=1, max_tokens=4, temperature=1.0, top_p=1.0,
        top_k=None, stop_token_ids=stops, min_tokens=1, greedy=False,
    )  # fmt: skip  # more than a step's token budget (2,048): the engine died there while it chunked seeded prefills
    assert len(sampled.token_ids) == 256 and all(sampled.token_ids)
    for min_tokens in (0, 1):
        sampled = server.generate(
            prompts, [11, 12, 13, 14], seed=5, max_tokens=8, temperature=1.0, top_p=1.0, top_k=None,
            stop_token_ids=stops, min_tokens=min_tokens, greedy=False,
        )  # fmt: skip
        for prompt, tokens, vllm_log_probs in zip(prompts, sampled.token_ids, sampled.log_probs):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            log_probs = torch.log_softmax(logits.float(), -1)
            trainer = log_probs.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
            if min_tokens:
                trainer[0] -= torch.log1p(-log_probs[0, stops].exp().sum())
            torch.testing.assert_close(torch.tensor(vllm_log_probs), trainer, atol=1e-4, rtol=0)


def test_pushed_weights_full_and_lora_merged_are_what_the_server_generates_with(
    vllm_server, tokenizer, prompts, tmp_path
):
    import peft
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from fsdp_recipes.train.weight_sync import ServerWeights

    server = connect(vllm_server)
    accelerator = Accelerator(cpu=True)
    try:
        pushes = ServerWeights(accelerator, server, tmp_path / "weights", lambda step: step())
        model = load(vllm_server.model)
        torch.manual_seed(3)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)
        expected = greedy(model, tokenizer, prompts)
        assert pushes.push(model, version=1) and not pushes.push(model, version=1)  # once per policy version
        assert (
            greedy(model, tokenizer, prompts, server) == expected != greedy(load(vllm_server.model), tokenizer, prompts)
        )
        adapted = peft.get_peft_model(
            load(vllm_server.model), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        )
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.3)
        adapted_expected = greedy(adapted, tokenizer, prompts)
        pushes.push(adapted, version=2)  # the merge works on copies: the trained model keeps its own weights
        assert greedy(adapted, tokenizer, prompts, server) == greedy(adapted, tokenizer, prompts) == adapted_expected
        assert adapted_expected != expected
        assert sorted(path.name for path in (tmp_path / "weights").iterdir()) == ["policy-0000002"]  # older removed
        from fsdp_recipes.train.vllm_client import ServerError, VLLMServer

        other = VLLMServer.connect(vllm_server.url, wait=5, request_timeout=60, model_name="m", owner="another run")
        other.claim()  # a second run pointed at the same server: this run's next push is refused, not mixed in
        with pytest.raises(ServerError, match="now serves another run"):
            pushes.push(model, version=3)
        pushes.close()
        assert not (tmp_path / "weights").exists()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_hung_server_is_an_error_once_vllm_request_timeout_has_passed(vllm_server, prompts):
    """The server stopped (SIGSTOP: it accepts the connection and never answers): the request gives up after its
    timeout with the error a run stops on, instead of waiting for ever."""
    import signal
    import time

    from fsdp_recipes.train.vllm_client import ServerError, VLLMServer

    server = connect(vllm_server)
    hung = VLLMServer(vllm_server.url, request_timeout=2)
    hung.info = server.info
    os.kill(vllm_server.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(ServerError, match="did not answer POST /v1/completions .*vllm_request_timeout, 2 s"):
            hung.generate(
                prompts, [1, 2, 3, 4], seed=0, max_tokens=4, temperature=1.0, top_p=1.0, top_k=None,
                stop_token_ids=[], min_tokens=0, greedy=False,
            )  # fmt: skip
    finally:
        os.kill(vllm_server.process.pid, signal.SIGCONT)
    assert time.monotonic() - started < 15
    assert server.generate(
        prompts[:1], [1], seed=0, max_tokens=2, temperature=1.0, top_p=1.0, top_k=None, stop_token_ids=[],
        min_tokens=0, greedy=True,
    ).token_ids  # fmt: skip  # going on answers again


def test_eval_generates_through_the_server_what_generate_writes(vllm_server, chat_data, tmp_path):
    """eval.py with use_vllm: the evaluated model's weights pushed, then the same greedy predictions and exact
    match as transformers' generate; lm-eval's generation task too (its answers, document by document)."""
    values = dict(
        model_name_or_path=str(vllm_server.model), dataset_name=str(chat_data), metrics=["exact_match"],
        max_eval_samples=8, max_new_tokens=8, per_device_eval_batch_size=4, report_to="none",
        benchmark_tasks=["demo_reverse"], benchmark_limit=8,
    )  # fmt: skip
    predictions, answers = {}, {}
    for name, backend in (("generate", {}), ("vllm", {"use_vllm": True, "vllm_server_base_url": vllm_server.url})):
        run_recipe_in_process("eval", tmp_path, name, {**values, "output_dir": str(tmp_path / name), **backend})
        predictions[name] = (tmp_path / name / "eval_predictions.jsonl").read_text()
        samples = (tmp_path / name / "lm_eval_samples.jsonl").read_text().splitlines()
        answers[name] = [json.loads(line)["resps"] for line in samples]
    assert predictions["vllm"] == predictions["generate"] and predictions["vllm"].count("\n") == 8
    assert answers["vllm"] == answers["generate"] and len(answers["vllm"]) == 8
    assert any(answer[0][0] for answer in answers["vllm"])  # answers, not empty strings
    assert not (tmp_path / "vllm" / ".vllm_weights").exists()


def test_on_policy_distillation_samples_the_student_through_the_server(vllm_server, chat_data, tmp_path):
    values = dict(
        model_name_or_path=str(vllm_server.model), teacher_model_name_or_path=str(vllm_server.model),
        dataset_name=str(chat_data), output_dir=str(tmp_path / "out"), max_length=64, max_new_tokens=8,
        per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to="none", lmbda=1.0, kd_ratio=1.0,
        use_vllm=True, vllm_server_base_url=vllm_server.url, learning_rate=1e-2, exact_match_eval_samples=0,
        packing=False,
    )  # fmt: skip
    run_recipe_in_process("distill", tmp_path, "distill", values)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["vllm_weight_pushes"] == 2  # before each step's samples: the student changed in between
    assert [r["on_policy"] for r in step_records(tmp_path / "out").values()] == [1.0, 1.0]


def test_asynchronous_rounds_lag_one_step_and_resume_exactly(vllm_server, vllm_prompts, tmp_path, monkeypatch):
    """The next round is sampled while this one trains, by the policy one step older: the importance weights see
    the gap (a larger sampler/trainer difference than synchronous rounds); a checkpoint keeps the round asked for
    ahead, so a run stopped after step 5 and resumed from step 4 trains on the same completions, to the same loss."""
    from fsdp_recipes.common.faults import FAULT_ENV, InjectedFault

    common = dict(per_device_train_batch_size=16, per_device_eval_batch_size=16, max_steps=8)
    values = {
        name: vllm_grpo_values(vllm_server.model, vllm_prompts, tmp_path / name, vllm_server, **common, **extra)
        for name, extra in (("sync", {}), ("async", {"async_generation": True}))
    }
    for name in ("sync", "async"):
        run_recipe_in_process("grpo", tmp_path, name, values[name])
    sync, whole = step_records(tmp_path / "sync"), step_records(tmp_path / "async")
    summary = json.loads((tmp_path / "async" / "run_summary.json").read_text())
    assert summary["vllm_weight_pushes"] == 7  # steps 1-7, each before the next round is asked for; none after the last
    assert whole[8]["reward"] > whole[1]["reward"]
    late = range(4, 9)
    lagging = sum(whole[s]["sampling/sampling_logp_difference/mean"] for s in late)
    assert lagging > 3 * sum(sync[s]["sampling/sampling_logp_difference/mean"] for s in late)
    monkeypatch.setenv(FAULT_ENV, "raise-after-step:5")
    values["async"]["output_dir"] = str(tmp_path / "stopped")
    with pytest.raises(InjectedFault):
        run_recipe_in_process("grpo", tmp_path, "stopped", values["async"])
    monkeypatch.delenv(FAULT_ENV)
    run_recipe_in_process("grpo", tmp_path, "resumed", {**values["async"], "resume_from_checkpoint": "latest"})
    resumed = step_records(tmp_path / "stopped")
    assert [resumed[s]["loss"] for s in range(1, 9)] == [whole[s]["loss"] for s in range(1, 9)]
    assert completions_of(tmp_path / "stopped") == completions_of(tmp_path / "async")


@pytest.fixture(scope="module")
def two_process_runs(vllm_server, vllm_prompts, tmp_path_factory) -> dict[str, Path]:
    """2-process FSDP2 GRPO through the server, 12 steps (full) then 4 steps (LoRA): one server holds one policy."""
    tmp = tmp_path_factory.mktemp("vllm_grpo")
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, max_steps=4, learning_rate=5e-2)
    runs = {"full": {}, "lora": lora}
    for name, extra in runs.items():
        run_launched(
            GRPO, tmp, name, vllm_grpo_values(vllm_server.model, vllm_prompts, tmp / name, vllm_server, **extra)
        )
    return {name: tmp / name for name in runs}


def test_two_processes_learn_through_the_server_with_its_weights_kept_in_step(
    two_process_runs, vllm_server, vllm_prompts, tokenizer
):
    """Full fine-tuning learns the task (the held-out prompts' greedy reward goes up); at every step the server's
    log-probabilities of the sampled tokens are the trainer's (the policy pushed after each step, LoRA merged):
    without the pushes, 12 steps at this learning rate would leave them far apart."""
    import importlib.util

    full, lora = step_records(two_process_runs["full"]), step_records(two_process_runs["lora"])
    assert sum(full[s]["reward"] for s in (10, 11, 12)) > 3 * sum(full[s]["reward"] for s in (1, 2, 3)) + 0.5
    for records in (full, lora):
        for record in records.values():
            assert record["sampling/sampling_logp_difference/max"] < 0.05, record
    assert sum(r["grad_norm"] for r in lora.values()) > 0 and lora[4]["reward"] != lora[1]["reward"]
    summary = json.loads((two_process_runs["full"] / "run_summary.json").read_text())
    assert summary["vllm_weight_pushes"] == 12 and "vLLM server at" in summary["generation"]
    assert not (two_process_runs["full"] / ".vllm_weights").exists()
    spec = importlib.util.spec_from_file_location("reward", vllm_prompts / "letter_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    held_out = [json.loads(line)["prompt"] for line in (vllm_prompts / "held_out.jsonl").read_text().splitlines()]
    encoded = [tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in held_out]

    def held_out_reward(folder: Path) -> float:
        texts = tokenizer.batch_decode(greedy(load(folder), tokenizer, encoded), skip_special_tokens=True)
        return sum(reward.share_of_a([[{"content": text}] for text in texts])) / len(texts)

    assert held_out_reward(two_process_runs["full"]) > held_out_reward(vllm_server.model) + 0.3


@pytest.fixture(scope="module")
def stopped_by_the_server(two_process_runs, vllm_server, vllm_prompts, tmp_path_factory) -> dict:
    """A 2-process run (the full run's settings) whose ranks pause before step 6's update (FSDP_RECIPES_FAULT) while
    the server is killed; once it has stopped, the server is started again on the same port, in the background (the
    test after the next waits for it)."""
    from fsdp_recipes.common.faults import FAULT_ENV, RELEASE_ENV

    tmp = tmp_path_factory.mktemp("vllm_killed")
    values = vllm_grpo_values(vllm_server.model, vllm_prompts, tmp / "out", vllm_server)
    release = tmp / "release"
    outcome = {}

    def stopped_run():
        outcome["result"] = run_launched(
            GRPO, tmp, "run", values, expect_success=False,
            env={FAULT_ENV: "pause-before-step:6", RELEASE_ENV: str(release)},
        )  # fmt: skip

    thread = threading.Thread(target=stopped_run)
    thread.start()
    paused = [Path(f"{release}.paused-{rank}") for rank in (0, 1)]
    for _ in range(2400):
        if all(path.exists() for path in paused) or not thread.is_alive():
            break
        thread.join(0.1)
    assert all(path.exists() for path in paused), outcome
    vllm_server.stop()
    release.touch()
    thread.join(240)
    vllm_server.start()
    return {"tmp": tmp, "values": values, "result": outcome["result"]}


def test_a_server_killed_mid_run_stops_every_rank_with_one_error_line_and_keeps_the_checkpoint(stopped_by_the_server):
    """Step 7's push finds the server gone: every rank stops (exit 2) with one error line, checkpoint step 4 kept,
    marked for the same command to resume, and no model exported."""
    result, out = stopped_by_the_server["result"], stopped_by_the_server["tmp"] / "out"
    assert result.returncode != 0  # the launcher's own status: each rank exits 2 (a user error)
    assert "exitcode  : 2" in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and "did not answer" in errors[0], result.stderr[-3000:]
    assert "once the server answers, the same command resumes from step-00000004" in errors[0]
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert (out / "checkpoints" / "step-00000004").is_dir() and not (out / "checkpoints" / "step-00000008").exists()
    assert (out / "checkpoints" / "PREEMPTED").read_text().startswith("step-00000004")
    assert not (out / "model.safetensors").exists()


def test_a_mixture_of_experts_generates_and_takes_pushed_weights_as_transformers_does(
    tmp_path_factory, tmp_path, tokenizer, prompts
):
    """vLLM's own engine (the suite's server holds a dense model; it runs while that server starts again after the test
    above): the same greedy tokens as transformers for a tiny Qwen3-MoE, then after each of two pushes of changed
    weights (vLLM on CPU packs the experts at load, and its
    in-place reload did not pack them again: the worker extension does)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from fsdp_recipes.models.serving_weights import write_serving_weights

    require_vllm_environment()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    expected = [greedy(model, tokenizer, prompts)]
    accelerator = Accelerator(cpu=True)
    try:
        for push in (1, 2):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.2)
            write_serving_weights(accelerator, model, tmp_path / f"push{push}", dtype=None)
            expected.append(greedy(model, tokenizer, prompts))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    command = [str(VLLM_PYTHON), str(REPO / "tests" / "scripts" / "vllm_greedy.py"), str(tmp_path / "moe")]
    command += [json.dumps(prompts), "--extension-dir", str(vllm_extension_folder(tmp_path_factory))]
    command += ["--weights", str(tmp_path / "push1"), str(tmp_path / "push2")]
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-4000:]
    produced = json.loads(lines[0].removeprefix("RESULT "))
    assert [produced["before"], *produced["after"]] == expected
    assert expected[0] != expected[1] != expected[2]


def test_the_same_command_resumes_once_the_server_is_back_and_ends_as_the_uninterrupted_run(
    stopped_by_the_server, two_process_runs, vllm_server
):
    vllm_server.wait_ready()  # started again, on the same port, by the fixture
    tmp, values = stopped_by_the_server["tmp"], stopped_by_the_server["values"]
    result = run_launched(GRPO, tmp, "run", values)  # the same command: the marked checkpoint is picked up by itself
    assert "was stopped by its vLLM server: resuming from step-00000004" in result.stdout + result.stderr
    whole, resumed = step_records(two_process_runs["full"]), step_records(tmp / "out")
    for step in range(5, 13):
        assert resumed[step]["reward"] == whole[step]["reward"], step
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5, abs=1e-7), step
