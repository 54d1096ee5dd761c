"""The adapter folder a LoRA/QLoRA run leaves behind (fsdp_recipes.models.adapters trains it), verified.

`export_adapter_folder` (collective, at the end of a run) gathers every adapter tensor from the shards of all ranks,
writes a peft adapter folder, reads it back onto a fresh copy of the base and compares its logits with the trained
model's; with `export_merged_model` also the merged model (`MERGED_FOLDER`), compared the same way. `load_base` and
`reload_adapter` load them as a user would; `fsdp-recipes export` (fsdp_recipes.publish.checkpoint_export) uses them
too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.distributed import tensor_parallel
from fsdp_recipes.models import adapters

MERGED_FOLDER = "merged"


class AdapterVerificationError(RuntimeError):
    """An exported adapter (or merged model), loaded back from disk, does not reproduce the trained model."""


def gathered_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded) trainable tensors of a prepared model, on CPU on rank 0 (empty elsewhere).
    Every element comes from the shards of all ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not torch.distributed.is_initialized():
        return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )


def verification_inputs(vocab_size: int, *, rows: int = 2, width: int = 16, seed: int = 0) -> torch.Tensor:
    """Token ids every rank builds identically, for comparing the trained model with what was written."""
    return torch.randint(0, vocab_size, (rows, width), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded model (every rank passes the same ids): fp32 logits on CPU."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), use_cache=False).logits.float().cpu()
    model.train(was_training)
    return logits


def logits_tolerance(mixed_precision: str) -> float:
    """Relative tolerance between the trained (sharded) model's logits and a reloaded fp32 copy's: the same fp32
    arithmetic up to reduction order, or bf16/fp16 compute on one side."""
    return 1e-4 if mixed_precision in ("no", None) else 5e-2


def compare_logits(expected: torch.Tensor, actual: torch.Tensor, *, tolerance: float, what: str) -> float:
    """The largest absolute difference relative to the largest logit; raises AdapterVerificationError above
    `tolerance`."""
    scale = max(expected.abs().max().item(), 1.0)
    difference = (expected - actual).abs().max().item() / scale
    if not difference <= tolerance:
        raise AdapterVerificationError(
            f"{what}: its logits differ from the trained model's by {difference:.3g} "
            f"(relative; tolerance {tolerance:g})"
        )
    return difference


def load_base(
    model_name_or_path: str,
    *,
    task: str,
    revision: str = "main",
    trust_remote_code: bool = False,
    model_config=None,
    quantization_config=None,
    device=None,
):
    from fsdp_recipes.models.modeling import auto_model_class

    options: dict[str, Any] = {}
    if model_config is not None:
        model_config = copy.deepcopy(model_config)
        if hasattr(model_config, "quantization_config"):  # the trained model's; quantisation is chosen here
            del model_config.quantization_config
        options["config"] = model_config
    if quantization_config is not None:
        options.update(
            quantization_config=quantization_config,
            device_map={"": device or "cpu"},
            dtype=quantization_config.bnb_4bit_compute_dtype,
        )
    else:
        options["dtype"] = torch.float32
    if model_config is None:  # the folder's own config says which Auto class builds it (a vision-language model)
        from transformers import AutoConfig

        model_config_of_folder = AutoConfig.from_pretrained(
            model_name_or_path, revision=revision, trust_remote_code=trust_remote_code
        )
    else:
        model_config_of_folder = model_config
    return auto_model_class(task, model_config_of_folder).from_pretrained(
        model_name_or_path, revision=revision, trust_remote_code=trust_remote_code, **options
    )


def write_adapter_folder(unwrapped, state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Writes adapter_config.json and adapter_model.safetensors from the gathered `state` (peft keeps the adapter
    entries and drops the adapter name from the keys) and checks every tensor on disk against what was saved. Returns
    the saved tensors by their on-disk names."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    expected = get_peft_model_state_dict(unwrapped, state_dict=dict(state))
    with tensor_parallel.saved_as_one_model(unwrapped):
        unwrapped.save_pretrained(folder, state_dict=dict(state), safe_serialization=True)
    on_disk = load_file(folder / "adapter_model.safetensors")
    problems = [f"{key}: missing from the file" for key in sorted(expected.keys() - on_disk.keys())]
    problems += [f"{key}: not in the trained adapter" for key in sorted(on_disk.keys() - expected.keys())]
    problems += [
        f"{key}: values on disk differ from the trained ones"
        for key in sorted(expected.keys() & on_disk.keys())
        if not torch.equal(expected[key].cpu(), on_disk[key])
    ]
    if problems:
        raise AdapterVerificationError("adapter export verification failed:\n  " + "\n  ".join(problems))
    return on_disk


def export_adapter_folder(
    accelerator,
    model: torch.nn.Module,
    tokenizer,
    output_dir: str | Path,
    *,
    task: str,
    config,
    card_writer,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Collective. `output_dir` becomes a peft adapter folder (adapter_config.json, adapter_model.safetensors,
    tokenizer, card with base_model and library_name: peft), and with `export_merged_model` also `output_dir/merged`,
    a plain transformers model. Before returning, both are loaded back from disk onto a fresh base and must reproduce
    the trained model's logits. `card_writer(folder, library_name)` writes the model card. `dtype`: the merged
    model's weights are written in it (None: fp32)."""
    output_dir = Path(output_dir)
    unwrapped = accelerator.unwrap_model(model)
    state = gathered_trainable_state(model)
    inputs = verification_inputs(unwrapped.config.get_text_config().vocab_size)
    trained_logits = logits_of(model, inputs)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_adapter_folder(unwrapped, state, output_dir)
        _point_adapter_config_at_base(output_dir, config.model_name_or_path)
        tokenizer.save_pretrained(output_dir)
        tolerance = logits_tolerance(accelerator.mixed_precision)
        trained_config = unwrapped.get_base_model().config
        reloaded = reload_adapter(
            output_dir,
            config,
            task=task,
            model_config=trained_config,
            quantized=config.load_in_4bit,
            device=accelerator.device,
        )
        compare_logits(
            trained_logits,
            logits_of(reloaded, inputs),
            tolerance=tolerance,
            what=f"the adapter in {output_dir} loaded onto {config.model_name_or_path}",
        )
        if config.export_merged_model:
            merged_dir = output_dir / MERGED_FOLDER
            if config.load_in_4bit:  # merge into the full-precision base, not into re-quantised 4-bit weights
                reloaded = reload_adapter(output_dir, config, task=task, model_config=trained_config, quantized=False)
            expected = logits_of(reloaded, inputs)
            save_merged_model(reloaded, merged_dir, dtype=dtype, task=task)
            tokenizer.save_pretrained(merged_dir)
            merged = load_base(str(merged_dir), task=task, trust_remote_code=config.trust_remote_code)
            compare_logits(
                expected,
                logits_of(merged, inputs),
                tolerance=merged_tolerance(dtype),
                what=f"the merged model in {merged_dir}",
            )
            card_writer(merged_dir, "transformers")
        card_writer(output_dir, "peft")
    accelerator.wait_for_everyone()
    return output_dir if accelerator.is_main_process else None


def save_merged_model(adapted, folder: Path, *, dtype: torch.dtype | None, task: str) -> None:
    """The base with the adapter merged in, as a plain transformers model folder whose floating weights (and config
    dtype) are `dtype` (None: fp32, as merged)."""
    from fsdp_recipes.models.export_dtype import cast_floating, kept_in_fp32, write_config_dtype
    from fsdp_recipes.models.modeling import tied_duplicate_names

    merged = adapted.merge_and_unload()
    if dtype is None or dtype == torch.float32:
        merged.save_pretrained(folder, safe_serialization=True)
        return
    duplicates = tied_duplicate_names(merged.config, task=task)
    state = {k: v for k, v in merged.state_dict().items() if k not in duplicates}
    state = cast_floating(state, dtype, kept_in_fp32(merged, dtype))
    merged.save_pretrained(folder, state_dict=state, safe_serialization=True)
    write_config_dtype(folder, dtype)


def merged_tolerance(dtype: torch.dtype | None) -> float:
    """Relative logit difference allowed between the adapter on its fp32 base and the merged model read back: fp32
    arithmetic up to summation order, or weights rounded to 16 bits."""
    return 1e-4 if dtype is None or dtype == torch.float32 else 5e-2


def reload_adapter(folder: str | Path, config, *, task: str, model_config, quantized: bool, device=None):
    """A fresh copy of the base with the adapter in `folder`, as a user would load it: fp32 on CPU, or (QLoRA) the
    same 4-bit quantisation the training used, on `device`. `model_config` is the trained model's (a classifier's
    labels and pad token are not in the base's)."""
    from peft import PeftModel

    base = load_base(
        config.model_name_or_path,
        task=task,
        revision=config.model_revision,
        trust_remote_code=config.trust_remote_code,
        model_config=model_config,
        quantization_config=adapters.quantization_config(config) if quantized else None,
        device=device,
    )
    return PeftModel.from_pretrained(base, str(folder))


def _point_adapter_config_at_base(folder: Path, base_model: str | None) -> None:
    """peft records the base model as the model's `name_or_path`; make it the recipe's model_name_or_path, which is
    what PeftModel/AutoPeftModel users need."""
    path = folder / "adapter_config.json"
    values: dict[str, Any] = json.loads(path.read_text())
    if base_model:
        values["base_model_name_or_path"] = base_model
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
