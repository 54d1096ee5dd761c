"""Runs inside vLLM's worker processes, in the vLLM environment (not the recipes'): the methods that
`fsdp-recipes vllm-serve` adds to every worker (vLLM's `--worker-extension-cls`), which a recipe calls over the server's
`/collective_rpc` (`train.vllm_client`). It imports nothing of this package, so the vLLM environment needs none of the
recipes' dependencies: only this file on its path.

- `fsdp_recipes_describe`: what the server holds (architecture, shapes, context, how it reports log-probabilities), for
  the checks a run makes before it loads any weights;
- `fsdp_recipes_claim`: the run whose policy the server holds from now on (two runs pushing their weights to one
  server would each generate with the other's);
- `fsdp_recipes_load_weights`: the weights a run wrote (a safetensors folder in checkpoint format) loaded in place. On
  CPU, vLLM packs each linear layer's weight for oneDNN when it loads; its in-place reload repacks the layers it
  loads, but an output layer tied to the input embedding is loaded under the embedding's name only, so its packed
  copy kept the old weights (completions followed the new embedding and the old output layer). It is repacked here.
"""

from __future__ import annotations

# the config entries that say two models have the same layout (a model of another shape cannot take the weights)
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "tie_word_embeddings",
)


class WeightSync:
    """Mixed into vLLM's worker class: `self.model_runner` is the worker's."""

    _fsdp_recipes_owner: str | None = None

    def fsdp_recipes_claim(self, owner: str) -> dict:
        previous, self._fsdp_recipes_owner = self._fsdp_recipes_owner, owner
        return {"previous": previous}

    def fsdp_recipes_describe(self) -> dict:
        runner = self.model_runner
        model_config = runner.model_config
        hf_config = model_config.hf_text_config
        parallel = runner.vllm_config.parallel_config
        return {
            "architecture": type(runner.get_model()).__name__,
            "shape": {key: getattr(hf_config, key) for key in SHAPE_KEYS if getattr(hf_config, key, None) is not None},
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": int(model_config.max_model_len),
            "logprobs_mode": str(getattr(model_config, "logprobs_mode", "")),
            "tensor_parallel_size": int(parallel.tensor_parallel_size),
            "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
            "data_parallel_size": int(parallel.data_parallel_size),
            "device": str(runner.device),
        }

    def fsdp_recipes_load_weights(self, weights_path: str, owner: str) -> dict:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        if owner != self._fsdp_recipes_owner:
            return {"refused": True, "owner": self._fsdp_recipes_owner}
        runner = self.model_runner
        runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repacked = 0
        if current_platform.is_cpu():
            for module in runner.get_model().modules():
                if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                    module.quant_method.process_weights_after_loading(module)
                    repacked += 1
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:  # the experts, packed for CPU's grouped GEMM on the first load only
                    kernel.fused_experts.process_weights_after_loading(module)
                    repacked += 1
        return {"weights_path": weights_path, "repacked": repacked}
