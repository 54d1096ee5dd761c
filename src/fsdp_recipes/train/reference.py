"""The frozen reference model of preference tuning: each row's summed completion log-probability under the model as
it was before training, three ways (`reference_mode`):

- "adapters": with LoRA, the policy with its adapters switched off is the reference: no second model;
- "model": a frozen copy, loaded like the policy and sharded like it by FSDP2 (per decoder layer, same mixed
  precision, through accelerate's own FSDP2 preparation, since `accelerator.prepare` takes one model with its
  optimizer): a second copy of the weights, at the compute dtype, sharded, and a second forward per step;
- "precomputed": one pass of the untrained policy over every pair before the first step stores the values; no
  reference is kept in memory after that. They are written to `output_dir/reference_log_probs.json` and read back
  by a resumed run (the policy has changed by then, so they could not be recomputed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import Accelerator

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.train.losses import TokenLoss, sequence_log_probs

MODES = ("adapters", "model", "precomputed")
PRECOMPUTED_FILE = "reference_log_probs.json"


def mode_for(*, precompute: bool, use_peft: bool) -> str:
    """Where reference values come from: a pass before training, the policy with its adapters off, or a copy."""
    if precompute:
        return "precomputed"
    return "adapters" if use_peft else "model"


def frozen_copies(mode: str) -> int:
    """Model copies the reference adds to what each device holds (for the memory estimate)."""
    return 1 if mode == "model" else 0


def shard_frozen_copy(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model`, frozen and in eval mode, sharded as accelerate shards the policy (the Accelerate config's wrap
    classes, resharding and mixed precision); unchanged without FSDP but moved to the device."""
    from accelerate.utils import DistributedType

    model.requires_grad_(False)
    model.eval()
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("a reference model copy needs FSDP2 (fsdp_version: 2); or set precompute_ref_log_probs: true")
    return model.to(accelerator.device)


class ReferenceLogProbs:
    """`reference(batch)`: the reference's summed completion log-probability of every row of a pair batch (chosen
    rows, then rejected ones), without gradients. A collective under FSDP (every rank calls it on every batch)."""

    def __init__(self, mode: str, *, policy: torch.nn.Module | None = None, token_loss: TokenLoss | None = None,
                 copy: torch.nn.Module | None = None, copy_loss: TokenLoss | None = None,
                 table: dict[int, tuple[float, float]] | None = None):
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
        missing = [int(i) for i in batch["pair_index"] if int(i) not in self.table]
        if missing:
            raise RuntimeError(f"no precomputed reference log-probabilities for pairs {missing[:5]}")
        chosen = [self.table[int(i)][0] for i in batch["pair_index"]]
        rejected = [self.table[int(i)][1] for i in batch["pair_index"]]
        return torch.tensor(chosen + rejected, dtype=torch.float32, device=batch["input_ids"].device)

    @property
    def description(self) -> str:
        return {"adapters": "the policy with its LoRA adapters disabled (no second model)",
                "model": "a frozen copy sharded like the policy (one more model in memory, one more forward per step)",
                "precomputed": f"precomputed before training ({len(self.table or {})} pairs; no model kept)"}[self.mode]


@torch.no_grad()
def precompute(accelerator: Accelerator, policy: torch.nn.Module, token_loss: TokenLoss, loader) -> dict[int, tuple[float, float]]:
    """Collective: the untrained policy's summed log-probabilities of each pair's answers over a prepared loader of
    pairs (accelerate splits it; `gather_for_metrics` drops the copies padding an uneven last batch), on every rank:
    {pair index: (chosen, rejected)}."""
    was_training = policy.training
    policy.eval()
    table: dict[int, tuple[float, float]] = {}
    try:
        for batch in loader:
            chosen, rejected = sequence_log_probs(token_loss.token_losses(policy, batch)).chunk(2)
            values = accelerator.gather_for_metrics(
                torch.stack([batch["pair_index"].double(), chosen.double(), rejected.double()], dim=1))
            for index, chosen_value, rejected_value in values.cpu().tolist():
                table[int(index)] = (chosen_value, rejected_value)
    finally:
        policy.train(was_training)
    return table


def write_tables(output_dir: str | Path, tables: dict[str, dict[int, tuple[float, float]]]) -> Path:
    """{split: table} as JSON (floats written exactly), on the main process."""
    path = Path(output_dir) / PRECOMPUTED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({split: {str(i): list(v) for i, v in sorted(table.items())}
                                for split, table in tables.items()}) + "\n")
    return path


def read_tables(checkpoint: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """The values a run precomputed, from the output_dir its checkpoint belongs to (`output_dir/checkpoints/step-N`)."""
    path = Path(checkpoint).resolve().parents[1] / PRECOMPUTED_FILE
    if not path.is_file():
        raise ConfigError(f"resuming with precompute_ref_log_probs needs the values the run computed before its first "
                          f"step, {path}, which is missing; they cannot be recomputed from a trained policy. Start a "
                          "new run, or resume with precompute_ref_log_probs: false (a reference model is loaded)")
    return {split: {int(i): (v[0], v[1]) for i, v in table.items()}
            for split, table in json.loads(path.read_text()).items()}
