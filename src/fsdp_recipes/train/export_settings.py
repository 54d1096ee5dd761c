"""What a training run publishes, and how: the exported weights' dtype, the chat template the model is trained and
exported with, and when a push happens. A base of TrainingConfig, in a module of its own so that these settings are
read (and their help kept) in one place."""

from __future__ import annotations

import dataclasses

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting

EXPORT_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
HUB_STRATEGIES = ("end", "every_save")


def check_hub_strategy(name: str, value: str) -> str | None:
    if value in ("checkpoint", "all_checkpoints"):
        return (
            f"{name} {value!r} uploads resumable checkpoints, which here are sharded per-rank state that only this "
            "run can read: use every_save (the exported model at every save) or end"
        )
    return checks.one_of(HUB_STRATEGIES)(name, value)


@dataclasses.dataclass
class PublishingFields:
    export_dtype: str = setting(
        "auto",
        "dtype of the exported weights: auto (the base model's, from its config.json, or torch_dtype/"
        "dtype when the recipe config sets one; float32 for a model initialised from a config naming none), "
        "float32, bfloat16 or float16. Training keeps fp32 master weights whatever this says; float32 exports "
        "of a bf16 base are twice the size and no more accurate than the base",
        resume="free",
        check=checks.one_of(EXPORT_DTYPE_CHOICES),
    )
    chat_template_path: str | None = setting(
        None,
        "TRL's name for setting the template on purpose: a .jinja file, or a tokenizer folder/Hub id whose "
        "template the model is trained and exported with (null: the tokenizer's own, or chat_template)",
        resume="free",
    )
    hub_strategy: str = setting(
        "end",
        "with push_to_hub, when the Hub gets the model: end (once, the exported folder) or every_save "
        "(also at every checkpoint: the model exported then, uploaded in the background; each save also "
        "gathers the full weights on the main process)",
        resume="free",
        check=check_hub_strategy,
    )

    def cross_field_problems(self) -> list[str]:
        if self.chat_template_path is not None and getattr(self, "chat_template", None) is not None:
            return ["set one of chat_template and chat_template_path (both set the model's template): keep one"]
        return []
