"""A frozen model beside the trained one (preference tuning's and GRPO's reference copy, distillation's teacher),
sharded the way accelerate shards the trained model."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from fsdp_recipes.common.errors import ConfigError


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
        raise ConfigError(
            "a frozen model copy (a reference or a teacher) is sharded with FSDP2 only: use an Accelerate config with "
            "fsdp_version: 2"
        )
    return model.to(accelerator.device)
