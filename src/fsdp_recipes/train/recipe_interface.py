"""What the shared layer asks of a training recipe: `RecipeTraits`, a base of `TrainingConfig` whose methods a recipe's
config class overrides to describe itself (its row length, its frozen models, what it generates, which fields a resume
must keep), so that nothing under src/ reads a field only one recipe has."""

from __future__ import annotations

import dataclasses
from typing import Any


class RecipeTraits:
    """Defaults for a recipe that trains one model on rows of `max_length` tokens; each method says what it answers."""

    max_length: int
    per_device_train_batch_size: int

    def row_length(self) -> int:
        """Tokens in one training row (what a row costs in activations; the estimator's sequence length)."""
        return self.max_length

    def micro_batch_rows(self) -> int:
        """Rows one process runs forward per micro-step (a preference pair is two rows)."""
        return self.per_device_train_batch_size

    def packs_examples(self) -> bool:
        """Whether a row holds several examples: they must not attend to each other (checked before loading)."""
        return False

    def frozen_model_copies(self) -> int:
        """Whole frozen copies of the model kept beside the trained one (a reference model), sharded like it."""
        return 0

    def frozen_models(self) -> list[str]:
        """Other models (folders or Hub ids) kept frozen beside the trained one, sharded like it at the compute dtype
        (a distillation teacher), for the memory estimate."""
        return []

    def loss_chunk_buffers(self) -> int:
        """fp32 tensors of loss_chunk_size x vocabulary the chunked loss holds at its peak (the memory estimate):
        cross-entropy reuses one; a loss comparing two models' distributions holds more."""
        return 1

    def sequence_split_problem(self) -> str | None:
        """Why this config's forwards cannot be split by position under sequence parallelism (None: they can)."""
        return None

    def generation_footprint(self) -> tuple[int, int, bool]:
        """What one generation pass during training holds (online RL): (sequences, tokens each) in its KV cache, and
        whether the whole model is gathered on every rank for it. (0, 0, False): the recipe does not generate."""
        return 0, 0, False

    def resume_sensitive_fields(self) -> tuple[str, ...]:
        """Fields that change the objective or the data (which rows, in which order, as which tokens): a resumed run
        must keep the checkpoint's values, or one run would mix two trainings, unless `allow_config_change` names
        them. Each field says so where it is declared: `metadata={"resume": "sensitive", ...}` ("free": a resume may
        change it; "fixed": the checkpoint's tensors depend on it). tests/test_config.py checks every field says."""
        return self._fields_whose_resume_is("sensitive")

    def resume_fixed_fields(self) -> tuple[str, ...]:
        """Fields the checkpoint's tensors depend on (LoRA's shapes): no resume with other values, allowed or not."""
        return self._fields_whose_resume_is("fixed")

    def _fields_whose_resume_is(self, kind: str) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(self) if field.metadata.get("resume") == kind)

    def memory_saving_alternatives(self) -> list[tuple[str, dict[str, Any]]]:
        """Changes to this config that save memory the shared layer cannot know of, as (description, {field: value})
        pairs; the description reads "what it saves: what it costs". The estimator suggests each (with its predicted
        total) when a launch does not fit, on top of the changes every recipe has (LoRA, a smaller micro-batch)."""
        return []
