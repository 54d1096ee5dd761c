"""The Hugging Face model folder written at the end of training, whatever the FSDP state-dict type.

With SHARDED_STATE_DICT, `save_model`/`save_pretrained` on an FSDP model leaves no usable weights; here the full
state dict is gathered (a collective), written by the main process as safetensors next to config, generation config,
tokenizer and a model card, then read back and checked tensor by tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from huggingface_hub import ModelCard, ModelCardData
from safetensors import safe_open

from fsdp_recipes.distributed import tensor_parallel
from fsdp_recipes.models.export_dtype import cast_floating, kept_in_fp32, write_config_dtype
from fsdp_recipes.models.modeling import auto_model_class, pipeline_tag, tied_duplicate_names


class ExportVerificationError(RuntimeError):
    """The weights read back from disk differ from the ones that were saved."""


def export_model_folder(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer,
    output_dir: str | Path,
    *,
    card: dict[str, Any],
    task: str = "causal-lm",
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Collective: every rank must call it. Returns the folder on the main process, None elsewhere. `dtype`: the
    floating weights are written (and read back, and named in config.json) in it; None: as trained (fp32)."""
    state_dict = accelerator.get_state_dict(model)  # full tensors on the main process, on CPU
    # torchao's float8 training keeps each converted weight in a subclass around the trained (high-precision) tensor
    state_dict = {name: getattr(tensor, "_tensor", tensor) for name, tensor in state_dict.items()}
    output_dir = Path(output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        for name in tied_duplicate_names(unwrapped.config, task=task):
            state_dict.pop(name, None)
        if dtype is not None:
            state_dict = cast_floating(state_dict, dtype, kept_in_fp32(unwrapped, dtype))
        # A shallow copy: save_pretrained pops entries as it writes them, and verification needs them all.
        with tensor_parallel.saved_as_one_model(unwrapped):
            unwrapped.save_pretrained(output_dir, state_dict=dict(state_dict), safe_serialization=True)
        if dtype is not None:
            write_config_dtype(output_dir, dtype)
        tokenizer.save_pretrained(output_dir)
        if written_names(output_dir) <= state_dict.keys():
            verify_saved_weights(output_dir, state_dict)
        else:  # transformers converted names on the way out (fused MoE experts): compare what loads back
            verify_by_loading(output_dir, state_dict, type(unwrapped))
        write_model_card(output_dir, **{**card, "task": task})
    accelerator.wait_for_everyone()
    return output_dir if accelerator.is_main_process else None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # only what this save wrote, whatever else the folder holds
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    return [folder / name for name in names if (folder / name).is_file()]


def written_names(folder: str | Path) -> set[str]:
    """The tensor names in the folder's safetensors files (the checkpoint's names, which transformers may have
    converted from the model's in-memory ones)."""
    names: set[str] = set()
    for file in _weight_files(Path(folder)):
        with safe_open(file, framework="pt") as reader:
            names.update(reader.keys())
    return names


def verify_by_loading(
    folder: str | Path,
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    model_class,
    dtype: torch.dtype | None = None,
) -> int:
    """For models whose checkpoint format differs from their in-memory layout (transformers 5 holds a mixture of
    experts' weights fused, `mlp.experts.gate_up_proj`, and writes and reads them per expert through its weight
    conversion): the folder loaded back with `from_pretrained` holds every trained tensor (`state_dict`, or its
    (name, tensor) pairs, which may be produced one at a time), equal in shape, dtype and values. Holds a second copy
    of the model in host memory while it checks. Returns the number of tensors checked."""
    pairs = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    if dtype is None and isinstance(state_dict, Mapping):
        dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
    loaded = model_class.from_pretrained(folder, dtype=dtype).state_dict()
    problems, checked = [], 0
    for key, expected in pairs:
        checked += 1
        got = loaded.get(key)
        if got is None:
            problems.append(f"{key}: not in the model loaded back from {folder}")
        elif got.shape != expected.shape or got.dtype != expected.dtype:
            problems.append(
                f"{key}: {tuple(got.shape)} {got.dtype} loaded back, {tuple(expected.shape)} {expected.dtype} saved"
            )
        elif not torch.equal(got, expected.cpu()):
            problems.append(f"{key}: the model loaded back differs from the trained weights")
    if problems:
        raise ExportVerificationError("export verification failed (loaded back):\n  " + "\n  ".join(problems))
    return checked


def verify_saved_weights(folder: str | Path, state_dict: dict[str, torch.Tensor]) -> int:
    """Every tensor in the folder's safetensors files equals (shape, dtype, values) the state-dict entry it was
    written from, and every entry is on disk, except tied duplicates, which must equal a tensor that is. Reads one
    tensor at a time. Returns the number of tensors checked."""
    problems, checked = [], 0
    on_disk_keys: set[str] = set()
    on_disk_dtypes: set[torch.dtype] = set()
    files = _weight_files(Path(folder))
    if not files:
        raise ExportVerificationError(f"no safetensors weights were written to {folder}")
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():
                on_disk_keys.add(key)
                expected = state_dict.get(key)
                if expected is None:
                    problems.append(f"{key}: on disk but not in the model's state dict")
                    continue
                saved = reader.get_tensor(key)
                checked += 1
                if saved.is_floating_point():
                    on_disk_dtypes.add(saved.dtype)
                if saved.shape != expected.shape or saved.dtype != expected.dtype:
                    problems.append(
                        f"{key}: {tuple(saved.shape)} {saved.dtype} on disk, {tuple(expected.shape)} {expected.dtype} saved"
                    )
                elif not torch.equal(saved, expected.cpu()):
                    problems.append(f"{key}: values on disk differ from the trained weights")
    for key in sorted(state_dict.keys() - on_disk_keys):
        tensor = state_dict[key].cpu()
        twins = [k for k in on_disk_keys if state_dict.get(k) is not None and state_dict[k].shape == tensor.shape]
        if not any(torch.equal(state_dict[k].cpu(), tensor) for k in twins):
            problems.append(f"{key}: missing from the saved files")
    declared = _declared_dtype(Path(folder))
    if declared is not None and on_disk_dtypes - {declared}:
        problems.append(f"config.json says dtype {declared} but the files hold {sorted(map(str, on_disk_dtypes))}")
    if problems:
        raise ExportVerificationError("export verification failed:\n  " + "\n  ".join(problems))
    return checked


def _declared_dtype(folder: Path) -> torch.dtype | None:
    config = folder / "config.json"
    declared = json.loads(config.read_text()).get("dtype") if config.is_file() else None
    return getattr(torch, declared, None) if isinstance(declared, str) else None


_CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

Fine-tuned with the FSDP Recipes `{{ recipe }}` recipe{% if base_model %} from [{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %} from a model initialised from a config{% endif %}{% if dataset %} on `{{ dataset }}`{% endif %}.

## Results

{{ results }}
{% if curves %}
![Training curves: loss and tokens per second against step]({{ curves }})
{% endif %}
## Recipe configuration

```yaml
{{ recipe_config }}
```

## Accelerate configuration used

The Accelerate/FSDP settings this run received from `accelerate launch`, and what they resolved to:

```yaml
{{ accelerate_config }}
```

## Use
{% if library_name == "peft" %}
A LoRA adapter: load its base model, then the adapter on top.

```python
from peft import PeftModel
from transformers import {{ model_class }}, AutoTokenizer

base = {{ model_class }}.from_pretrained("{{ base_model_path }}")
model = PeftModel.from_pretrained(base, "{{ model_path }}")  # model.merge_and_unload() gives a plain model
tokenizer = AutoTokenizer.from_pretrained("{{ model_path }}")
```
{% else %}
```python
from transformers import {{ model_class }}, AutoTokenizer

model = {{ model_class }}.from_pretrained("{{ model_path }}")
tokenizer = AutoTokenizer.from_pretrained("{{ model_path }}")
```
{% endif %}{% if recipe == "reward" %}
Score a prompt and an answer as they were trained: chat turns through the chat template, plain text as prompt +
answer + the end-of-sequence token (the score is read at the last token; without it a text answer is scored at its
last letter).

```python
turns = [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]
ids = tokenizer.apply_chat_template(turns, return_tensors="pt", return_dict=True)["input_ids"]
# plain text: ids = tokenizer(prompt + answer + tokenizer.eos_token, return_tensors="pt")["input_ids"]
score = model(input_ids=ids).logits[0, 0].item()
```
{% endif %}"""


def write_model_card(
    folder: str | Path,
    *,
    recipe: str,
    recipe_config: dict[str, Any],
    accelerate_config: dict[str, Any],
    metrics: dict[str, Any],
    base_model: str | None,
    dataset: str | None,
    hub_model_id: str | None = None,
    task: str = "causal-lm",
    eval_results: list | None = None,
    library_name: str = "transformers",
) -> Path:
    """`eval_results` (huggingface_hub EvalResults, see fsdp_recipes.publish.model_index) go into the card's model-index,
    which the Hub shows on the model page. `library_name` "peft": the folder is a LoRA adapter of `base_model`."""
    folder = Path(folder)
    dataset_id = dataset if dataset and not Path(dataset).exists() else None  # local paths are not Hub datasets
    card_data = ModelCardData(
        library_name=library_name,
        base_model=base_model if base_model and not Path(base_model).exists() else None,
        datasets=[dataset_id] if dataset_id else None,
        tags=["fsdp-recipes", recipe, "fsdp"] + (["lora"] if library_name == "peft" else []),
        pipeline_tag=pipeline_tag(task),
    )
    results = "\n".join(f"| {key} | {_format(value)} |" for key, value in metrics.items())
    card = ModelCard.from_template(
        card_data,
        template_str=_CARD_TEMPLATE,
        model_name=hub_model_id or folder.name,
        recipe=recipe,
        base_model=card_data.base_model,
        dataset=dataset,
        results=("| metric | value |\n|---|---|\n" + results) if results else "No metrics were recorded.",
        recipe_config=yaml.safe_dump(recipe_config, sort_keys=False).strip(),
        accelerate_config=yaml.safe_dump(accelerate_config, sort_keys=False).strip(),
        model_path=hub_model_id or str(folder),
        model_class=auto_model_class(task).__name__,
        curves="training_curves.png" if (folder / "training_curves.png").is_file() else None,
        library_name=library_name,
        base_model_path=base_model,
    )
    path = folder / "README.md"
    card.save(path)
    if eval_results:
        from fsdp_recipes.publish.model_index import update_card

        update_card(folder, eval_results, model_name=hub_model_id or folder.name, pipeline_tag=pipeline_tag(task))
    return path


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
