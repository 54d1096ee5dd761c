"""The frozen reference model of preference tuning: each row's summed completion log-probability under the model as
it was before training, three ways (`reference_mode`):

- "adapters": with LoRA, the policy with its adapters switched off is the reference: no second model;
- "model": a frozen copy, loaded like the policy and sharded like it by FSDP2 (per decoder layer, same mixed
  precision, through accelerate's own FSDP2 preparation, since `accelerator.prepare` takes one model with its
  optimizer): a second copy of the weights, at the compute dtype, sharded, and a second forward per step;
- "precomputed": one pass of the untrained policy over every pair before the first step stores the values; no
  reference is kept in memory after that. They are keyed by each pair's content (`preference.content_key`: a hash of
  its token ids and targets), written to `output_dir/reference_log_probs.json` and into every checkpoint (committed
  with it), and read back from the checkpoint by a resumed run (the policy has changed by then, so they could not be
  recomputed). A resume whose data holds a pair without a stored value (edited or added since) is refused before
  loading (`check_tables`): a value is never given to a pair it was not computed for.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from fsdp_recipes.common.arguments import setting
from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.distributed.collectives import gather_for_metrics
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train import frozen_copy
from fsdp_recipes.train.losses import TokenLoss, sequence_log_probs

MODES = ("adapters", "model", "precomputed")
PRECOMPUTED_FILE = "reference_log_probs.json"


def mode_for(*, precompute: bool, use_peft: bool) -> str:
    """Where reference values come from: a pass before training, the policy with its adapters off, or a copy."""
    if precompute:
        return "precomputed"
    return "adapters" if use_peft else "model"


def frozen_copies(mode: str | None) -> int:
    """Model copies the reference adds to what each device holds (for the memory estimate)."""
    return 1 if mode == "model" else 0


@dataclasses.dataclass
class ReferenceFields:
    """The settings of a loss that keeps the policy near a frozen reference (DPO, KTO; TRL's names): a base a recipe
    config puts before `TrainingConfig`. A recipe whose loss may need no reference overrides `needs_reference`."""

    beta: float = setting(
        0.1, "how far the policy may drift from the reference: larger keeps it closer", resume="sensitive"
    )
    max_prompt_length: int | None = setting(
        None, "prompts longer than this keep their end (null: only max_length applies)", resume="sensitive"
    )
    precompute_ref_log_probs: bool = setting(
        False,
        "one pass before training stores the reference's values: no reference model in memory or "
        "forward per step afterwards, at the cost of that pass",
        resume="free",
    )

    def needs_reference(self) -> bool:
        return True

    def reference_mode(self) -> str | None:
        """One of MODES, or None when the loss needs no reference (nothing loaded, nothing precomputed), as GRPO's
        `reference_mode` at beta 0."""
        if not self.needs_reference():
            return None
        return mode_for(precompute=self.precompute_ref_log_probs, use_peft=self.use_peft)

    def frozen_model_copies(self) -> int:
        return frozen_copies(self.reference_mode())

    def min_max_length(self) -> tuple[int, str]:
        return 2, "a row needs a prompt token and an answer token predicted from it"

    def memory_saving_alternatives(self) -> list[tuple[str, dict]]:
        if not self.frozen_model_copies():
            return []
        return [
            (
                "no reference model copy: one pass of the starting model over the data before training; no copy kept",
                {"precompute_ref_log_probs": True},
            )
        ]

    def cross_field_problems(self) -> list[str]:
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.max_length:
            return [f"max_prompt_length must be >= 1 and < max_length ({self.max_length}), or null"]
        return []


def for_splits(
    mode: str | None,
    accelerator: Accelerator,
    loaders: dict[str, Any],
    *,
    parallel: ParallelDims,
    policy: torch.nn.Module,
    token_loss: TokenLoss,
    copy: torch.nn.Module | None = None,
    stored: dict[str, Table] | None = None,
    write_to: str | Path | None = None,
) -> tuple[dict[str, ReferenceLogProbs | None], dict[str, Table] | None]:
    """Collective, after `accelerator.prepare`: ({split: its reference values}, the precomputed tables or None) for
    prepared in-order `loaders` of pairs. `mode` None (the loss needs no reference): None for every split. "model":
    `copy` (the starting weights, loaded unprepared) is sharded here, its loss computed as `token_loss` computes the
    policy's (split by position as the policy's, under sequence parallelism). "precomputed": `stored` (a resume's,
    from its checkpoint) or one pass of the untrained policy over the data-parallel ranks of `parallel` (the run's
    layout), written to `write_to` (main process) when given."""
    if mode is None:
        return dict.fromkeys(loaders), None
    if mode == "model":
        copy_loss = TokenLoss(
            copy,
            token_loss.implementation,
            chunk_size=token_loss.chunk_size,
            sequence_shards=token_loss.sequence_shards,
        )
        shared = ReferenceLogProbs("model", copy=frozen_copy.shard_frozen_copy(accelerator, copy), copy_loss=copy_loss)
        return dict.fromkeys(loaders, shared), None
    if mode == "adapters":
        return dict.fromkeys(loaders, ReferenceLogProbs("adapters", policy=policy, token_loss=token_loss)), None
    tables = stored or {
        name: precompute(accelerator, policy, token_loss, loader, parallel=parallel) for name, loader in loaders.items()
    }
    if accelerator.is_main_process and write_to is not None:
        write_tables(write_to, tables)
    return {name: ReferenceLogProbs("precomputed", table=table) for name, table in tables.items()}, tables


Table = dict[int, tuple[float, float]]  # a pair's content key -> its (chosen, rejected) reference log-probabilities


class ReferenceLogProbs:
    """`reference(batch)`: the reference's summed completion log-probability of every row of a pair batch (chosen
    rows, then rejected ones), without gradients. A collective under FSDP (every rank calls it on every batch)."""

    def __init__(
        self,
        mode: str,
        *,
        policy: torch.nn.Module | None = None,
        token_loss: TokenLoss | None = None,
        copy: torch.nn.Module | None = None,
        copy_loss: TokenLoss | None = None,
        table: Table | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"reference mode {mode!r} is not one of {MODES}")
        self.mode, self.policy, self.token_loss, self.copy, self.copy_loss = mode, policy, token_loss, copy, copy_loss
        self.table = table

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mode == "adapters":
            with self.policy.disable_adapter():
                return sequence_log_probs(self.token_loss.token_losses(self.policy, batch))
        if self.mode == "model":
            return sequence_log_probs(self.copy_loss.token_losses(self.copy, batch))
        keys = [int(key) for key in batch["pair_key"]]
        missing = [int(i) for i, key in zip(batch["pair_index"], keys) if key not in self.table]
        if missing:  # check_tables refuses such data before loading: reaching this is a bug
            raise RuntimeError(f"no precomputed reference log-probabilities for pairs {missing[:5]}")
        values = [self.table[key][0] for key in keys] + [self.table[key][1] for key in keys]
        return torch.tensor(values, dtype=torch.float32, device=batch["input_ids"].device)

    @property
    def description(self) -> str:
        return {
            "adapters": "the policy with its LoRA adapters disabled (no second model)",
            "model": "a frozen copy sharded like the policy (one more model in memory, one more forward per step)",
            "precomputed": f"precomputed before training ({len(self.table or {})} pairs of rows, by content; no model kept)",
        }[self.mode]


@torch.no_grad()
def precompute(
    accelerator: Accelerator, policy: torch.nn.Module, token_loss: TokenLoss, loader, *, parallel: ParallelDims
) -> Table:
    """Collective: the untrained policy's summed log-probabilities of each pair's answers over a prepared loader of
    pairs (accelerate splits it; `gather_for_metrics` drops the copies padding an uneven last batch, and those of a
    TP or SP group of `parallel`, the run's layout), on every rank: {pair content key: (chosen, rejected)}."""
    was_training = policy.training
    policy.eval()
    table: Table = {}
    try:
        for batch in loader:
            chosen, rejected = sequence_log_probs(token_loss.token_losses(policy, batch)).chunk(2)
            keys = gather_for_metrics(accelerator, batch["pair_key"], parallel=parallel)
            values = torch.stack([chosen.double(), rejected.double()], dim=1)
            values = gather_for_metrics(accelerator, values, parallel=parallel)
            for key, (chosen_value, rejected_value) in zip(keys.cpu().tolist(), values.cpu().tolist()):
                table[int(key)] = (chosen_value, rejected_value)
    finally:
        policy.train(was_training)
    return table


def tables_json(tables: dict[str, Table]) -> str:
    """{split: table} as JSON (floats written exactly), for output_dir and every checkpoint."""
    return (
        json.dumps(
            {
                "keyed_by": "content",
                "splits": {
                    split: {str(key): list(values) for key, values in sorted(table.items())}
                    for split, table in tables.items()
                },
            }
        )
        + "\n"
    )


def write_tables(output_dir: str | Path, tables: dict[str, Table]) -> Path:
    """`output_dir/reference_log_probs.json`, replaced atomically, on the main process."""
    path = Path(output_dir) / PRECOMPUTED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(tables_json(tables))
    os.replace(staging, path)
    return path


def read_tables(checkpoint: Path) -> dict[str, Table]:
    """The values a run precomputed before its first step, as `checkpoint` holds them. ConfigError when it holds none
    (or holds values by position, as runs before content keys stored them)."""
    path = Path(checkpoint) / PRECOMPUTED_FILE
    if not path.is_file():
        raise ConfigError(
            f"resuming with precompute_ref_log_probs needs the values the run computed before its first "
            f"step, {path}, which is missing; they cannot be recomputed from a trained policy. Start a "
            "new run, or resume with precompute_ref_log_probs: false (a reference model is loaded)"
        )
    stored = json.loads(path.read_text())
    if stored.get("keyed_by") != "content":
        raise ConfigError(
            f"{path} holds reference values by pair position (written before they were keyed by "
            "content), which a resume cannot match to its pairs safely. Start a new run, or resume with "
            "precompute_ref_log_probs: false (a reference model is loaded)"
        )
    return {
        split: {int(key): (values[0], values[1]) for key, values in table.items()}
        for split, table in stored["splits"].items()
    }


def read_checked(checkpoint: Path, pairs: dict[str, Any]) -> dict[str, Table]:
    """`read_tables`, then `check_tables` against the data ({split: tokenised pairs or None}): a resume's values."""
    tables = read_tables(checkpoint)
    check_tables(tables, pairs, checkpoint)
    return tables


def check_tables(tables: dict[str, Table], pairs: dict[str, Any], checkpoint: Path) -> None:
    """DataError, before loading, when a pair of the data (`{split: tokenised pairs or None}`) has no stored value:
    edited or added since the values were computed, and not computable from the trained policy."""
    for split, rows in pairs.items():
        if rows is None:
            continue
        table = tables.get(split, {})
        missing = [index for index, key in zip(rows["index"], rows["key"]) if key not in table]
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise DataError(
                f"{len(missing)} of the {len(rows)} {split} pairs have no precomputed reference value in {checkpoint} "
                f"(pair {shown}): they were edited or added since the run computed its values, which cannot be "
                "recomputed from the trained policy. Resume with the data the run started with, start a new run, or "
                "resume with precompute_ref_log_probs: false (a reference model is loaded)"
            )
