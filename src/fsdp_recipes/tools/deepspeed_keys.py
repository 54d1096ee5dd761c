"""The DeepSpeed config's keys as `fsdp-recipes from-deepspeed` (fsdp_recipes.tools.from_deepspeed) reads them: by
dotted path, remembering which were read so that every other one is reported (`Reader`), and the keys and sections with
no FSDP2 counterpart, each with the reason given for it (`NOT_CARRIED`, `NOT_CARRIED_SECTIONS`; docs/from-deepspeed.md).
"""

from __future__ import annotations

from typing import Any

from fsdp_recipes.common.errors import ConfigError

AUTO = "auto"

# DeepSpeed key (or a whole section) -> why nothing in FSDP2 / this repository corresponds to it.
NOT_CARRIED = {
    "zero_optimization.overlap_comm": "FSDP2 always overlaps communication with compute (it prefetches the next unit)",
    "zero_optimization.contiguous_gradients": "FSDP2 reduce-scatters each unit's gradients straight into its shards",
    "zero_optimization.reduce_bucket_size": "FSDP2 reduce-scatters per FSDP unit (a decoder layer), not per byte "
    "bucket",
    "zero_optimization.allgather_bucket_size": "FSDP2 all-gathers per FSDP unit (a decoder layer), not per byte bucket",
    "zero_optimization.allgather_partitions": "FSDP2 always all-gathers a unit's parameters in one collective",
    "zero_optimization.reduce_scatter": "FSDP2 always reduce-scatters gradients",
    "zero_optimization.round_robin_gradients": "a ZeRO-2 offload optimisation with no FSDP2 counterpart",
    "zero_optimization.sub_group_size": "the optimizer steps each rank's whole shard at once; there are no sub-groups",
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches one unit (a decoder layer) ahead, not a byte "
    "budget",
    "zero_optimization.stage3_param_persistence_threshold": "FSDP2 reshards every wrapped unit; parameters outside "
    "the decoder layers stay in the root unit, which is not resharded after forward",
    "zero_optimization.stage3_max_live_parameters": "FSDP2 keeps the current and the prefetched unit gathered: the "
    "unit size (a decoder layer, fsdp_transformer_layer_cls_to_wrap) is the knob",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 re-gathers a resharded unit whenever it is used again",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "nothing to set: the recipe always exports full "
    "weights at the end, and `fsdp-recipes export` turns any checkpoint into a model folder",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "nothing to set: the recipe always exports full "
    "weights at the end, and `fsdp-recipes export` turns any checkpoint into a model folder",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ (int8 weight all-gather): FSDP2 all-gathers in the "
    "compute dtype",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ (int8 frozen weights): FSDP2 keeps them in the "
    "parameter dtype",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ (int4 gradient reduce-scatter): FSDP2 reduces in the "
    "compute dtype",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hpZ (a second weight copy sharded within each node) has no "
    "FSDP2 counterpart; HSDP (accelerate_configs/hsdp_2x8gpu.yaml) keeps one whole replica per node instead",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS's two-level all-gather: FSDP2's HSDP gathers within "
    "the shard group only",
    "zero_optimization.elastic_checkpoint": "nothing to set: sharded (DCP) checkpoints load onto any number of "
    "processes",
    "zero_optimization.load_from_fp32_weights": "nothing to set: checkpoints hold the fp32 parameters FSDP trains",
    "zero_optimization.ignore_unused_parameters": "nothing to set: FSDP2 does not require every parameter to get a "
    "gradient",
    "zero_optimization.round_robin": "a ZeRO-2 offload optimisation with no FSDP2 counterpart",
    "zero_optimization.legacy_stage1": "a DeepSpeed implementation switch",
    "zero_optimization.memory_efficient_linear": "a DeepSpeed implementation switch",
    "zero_optimization.use_multi_rank_bucket_allreduce": "a DeepSpeed implementation switch",
    "zero_optimization.log_trace_cache_warnings": "a DeepSpeed logging switch",
    "zero_optimization.offload_param.pin_memory": "FSDP2's CPU offload pins host memory itself (accelerate does not "
    "expose the choice)",
    "zero_optimization.offload_optimizer.pin_memory": "FSDP2's CPU offload pins host memory itself (accelerate does "
    "not expose the choice)",
    "zero_optimization.offload_param.buffer_count": "DeepSpeed's offload buffers; FSDP2 moves one unit at a time",
    "zero_optimization.offload_param.buffer_size": "DeepSpeed's offload buffers; FSDP2 moves one unit at a time",
    "zero_optimization.offload_param.max_in_cpu": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.buffer_count": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.fast_init": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.pipeline_read": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.pipeline_write": "an NVMe offload setting",
    "fp16.hysteresis": "accelerate's gradient scaler lowers the scale at the first overflow (no hysteresis)",
    "fp16.consecutive_hysteresis": "accelerate's gradient scaler lowers the scale at the first overflow (no "
    "hysteresis)",
    "fp16.min_loss_scale": "accelerate's gradient scaler has no floor for the scale",
    "fp16.auto_cast": "FSDP's mixed precision casts parameters for compute; inputs are not cast separately",
    "fp16.fp16_master_weights_and_grads": "FSDP keeps fp32 master weights and reduces gradients in the compute dtype",
    "bf16.immediate_grad_update": "a DeepSpeed bf16-optimizer switch",
    "bf16.check_grad_overflow": "a DeepSpeed bf16-optimizer switch",
    "prescale_gradients": "FSDP2 divides gradients by the world size inside the reduce-scatter",
    "gradient_predivide_factor": "FSDP2 divides gradients by the world size inside the reduce-scatter",
    "sparse_gradients": "dense gradients only",
    "wall_clock_breakdown": "the recipe logs step time, tokens/s and data wait in metrics.jsonl",
    "memory_breakdown": "the run summary has the memory estimate and the metrics the peak memory",
    "zero_allow_untested_optimizer": "nothing to set: FSDP2 works with any torch optimizer",
    "zero_force_ds_cpu_optimizer": "nothing to set: the optimizer steps where the shards live",
    "dump_state": "a DeepSpeed debugging switch",
    "zero_optimization.offload_param.nvme_path": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.nvme_path": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload: FSDP2 offloads all of it or none",
    "optimizer.params.torch_adam": "nothing to set: the recipes use torch's AdamW",
    "optimizer.params.fused": "optim: adamw_torch_fused in the recipe config picks the fused kernel",
    "scheduler.params.last_batch_iteration": "nothing to set: a resumed run restores the schedule from its checkpoint",
}
NOT_CARRIED_SECTIONS = {
    "activation_checkpointing": "DeepSpeed's own checkpointing API (Megatron-style models); for Hugging Face models "
    "set fsdp_activation_checkpointing: true in the Accelerate config "
    "(accelerate_configs/fsdp_8gpu_activation_checkpointing.yaml) or gradient_checkpointing: true in the recipe",
    "flops_profiler": "the recipe logs FLOPs per token and MFU in metrics.jsonl",
    "comms_logger": "no communication logger; torch.profiler shows the collectives",
    "csv_monitor": "report_to supports tensorboard, wandb and trackio",
    "comet": "report_to supports tensorboard, wandb and trackio",
    "aio": "NVMe offload settings: FSDP2 offloads to CPU memory only",
    "amp": "NVIDIA Apex AMP: use bf16 or fp16 (mixed_precision)",
    "sparse_attention": "a DeepSpeed kernel; attn_implementation chooses the attention kernel",
    "data_efficiency": "DeepSpeed's data sampling and routing library",
    "curriculum_learning": "DeepSpeed's data sampling and routing library",
    "compression_training": "DeepSpeed's compression library",
    "autotuning": "DeepSpeed's autotuner; `fsdp-recipes estimate` predicts memory per GPU instead",
    "elasticity": "DeepSpeed's elastic batch sizes; resume on another number of processes keeps the global batch "
    "instead",
    "pipeline": "pipeline parallelism: FSDP2 recipes here shard data-parallel only",
    "checkpoint": "DeepSpeed checkpoint options (tag validation, universal checkpoints): sharded DCP checkpoints "
    "reshard on load without conversion",
    "nebula": "DeepSpeed's Azure checkpoint service",
    "eigenvalue": "a DeepSpeed training-dynamics tool",
    "progressive_layer_drop": "a DeepSpeed training technique with no counterpart here",
    "quantize_training": "DeepSpeed's quantisation-aware training",
    "tensor_parallel": "tensor parallelism: does not run on the pinned accelerate/transformers (docs/parallelism.md); "
    "FSDP2 recipes here shard data-parallel only",
    "sequence_parallel_size": "sequence parallelism: not in these recipes (context parallelism neither: "
    "docs/parallelism.md)",
    "data_types": "DeepSpeed gradient accumulation dtype: FSDP accumulates in fp32 sharded gradients",
}


def _leaves(config: dict, prefix: str = "") -> dict[str, Any]:
    found = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found.update(_leaves(value, path + "."))
        else:
            found[path] = value
    return found


class Reader:
    """The DeepSpeed settings by dotted path; remembers which were looked at, so that the rest can be reported."""

    def __init__(self, config: dict):
        self.leaves = _leaves(config)
        self.used: set[str] = set()

    def get(self, path: str, default: Any = None) -> Any:
        self.used.add(path)
        return self.leaves.get(path, default)

    def has(self, path: str) -> bool:
        return path in self.leaves

    def unused(self) -> list[str]:
        return [path for path in self.leaves if path not in self.used]


def as_int(value: Any, key: str) -> int | None:
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 0:
        raise ConfigError(f'{key} is {value!r}: expected a whole number or "auto"')
    return int(value)
