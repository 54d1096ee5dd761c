"""The CPU FSDP2 route and the degraded-launch guard (a real degraded launch: tests/test_all_ranks_stop.py). That an
FSDP2 launch really shards over gloo is checked on the shared reference run (tests/test_sft_recipe.py: every parameter
a Shard(0) DTensor): if an accelerate upgrade breaks the private switch in fsdp_recipes/distributed.py, those tests
fail."""

from __future__ import annotations

import pytest


def test_fsdp1_yaml_on_cpu_is_refused_with_a_clear_error(monkeypatch):
    import fsdp_recipes.distributed.accelerator as distributed
    from fsdp_recipes.common.errors import DistributedSetupError

    monkeypatch.setattr(distributed, "has_accelerator_device", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(DistributedSetupError, match="FSDP1 cannot run on CPU") as error:
        distributed.build_accelerator()
    assert "fsdp_version: 2" in str(error.value)


def test_guard_refuses_a_launch_that_degraded_into_independent_processes(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from fsdp_recipes.common.errors import DistributedSetupError
    from fsdp_recipes.distributed.accelerator import refuse_degraded_launch

    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun tells each process
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(DistributedSetupError, match="the launcher started 2 processes but accelerate joined 1"):
        refuse_degraded_launch(alone)
    refuse_degraded_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP))
