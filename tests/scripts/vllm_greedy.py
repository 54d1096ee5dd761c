"""Run with the vLLM environment's python (.venv-vllm), not the recipes': vLLM's offline engine on a model folder,
greedy completions of the prompts (token ids) as JSON on stdout; then, with --weights, the same after the engine
loaded each folder's weights in place, in turn (the worker extension that `fsdp-recipes vllm-serve` adds, the same load a run's push
makes). One process instead of a server: for a model the suite's one server does not serve (a mixture of experts)."""

import argparse
import json
import os
import sys

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", help="a JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--weights", nargs="*", default=[], help="folders of weights to load in turn, each then used")
    parser.add_argument("--extension-dir", required=True, help="the folder holding fsdp_recipes_vllm_worker.py")
    args = parser.parse_args()
    sys.path.insert(0, args.extension_dir)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLM(
        model=args.model, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
        distributed_executor_backend="uni", worker_extension_cls="fsdp_recipes_vllm_worker.WeightSync",
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(args.prompts)]

    def completions() -> list[list[int]]:
        return [list(output.outputs[0].token_ids) for output in engine.generate(prompts, greedy, use_tqdm=False)]

    results = {"before": completions(), "after": []}
    engine.collective_rpc("fsdp_recipes_claim", args=("tests/scripts/vllm_greedy.py",))
    for folder in args.weights:
        engine.collective_rpc("fsdp_recipes_load_weights", args=(folder, "tests/scripts/vllm_greedy.py"))
        engine.reset_prefix_cache()
        results["after"].append(completions())
    print("RESULT " + json.dumps(results))
