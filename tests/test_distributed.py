"""The CPU FSDP2 route and the degraded-launch guard. That an FSDP2 launch really shards over gloo is checked on the
shared reference run (tests/test_sft_recipe.py: every parameter a Shard(0) DTensor): if an accelerate upgrade breaks
the private switch in fsdp_recipes/distributed.py, those tests fail."""

from __future__ import annotations

import pytest

from conftest import REPO, base_recipe_values, launch, recipe_config

SFT_CLAIMING_A_DEVICE = REPO / "tests" / "scripts" / "sft_on_a_machine_claiming_a_device.py"


def test_fsdp1_yaml_on_cpu_is_refused_with_a_clear_error(monkeypatch):
    import fsdp_recipes.distributed as distributed
    from fsdp_recipes.errors import DistributedSetupError

    monkeypatch.setattr(distributed, "has_accelerator_device", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(DistributedSetupError, match="FSDP1 cannot run on CPU") as error:
        distributed.build_accelerator()
    assert "fsdp_version: 2" in str(error.value)


def test_guard_refuses_a_launch_that_degraded_into_independent_processes(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from fsdp_recipes.distributed import refuse_degraded_launch
    from fsdp_recipes.errors import DistributedSetupError

    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun tells each process
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(DistributedSetupError, match="the launcher started 2 processes but accelerate joined 1"):
        refuse_degraded_launch(alone)
    refuse_degraded_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP))


@pytest.mark.slow
def test_recipe_refuses_a_multi_gpu_launch_that_degraded_into_independent_processes(tmp_path, tiny_model_config, chat_data):
    # Without a device a MULTI_GPU launch now runs as MULTI_CPU (tests/test_topology_rehearsal.py); the wrapper makes
    # the recipe believe a device exists, so it builds a plain Accelerator(), which accelerate leaves degraded here.
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")
    config = recipe_config(tmp_path / "recipe.yaml", **values)
    result = launch(SFT_CLAIMING_A_DEVICE, ["--config", str(config)], accelerate_config=None,
                    launcher_args=["--multi_gpu"], timeout=120)
    assert result.returncode != 0
    assert "every process would train alone" in result.stderr
    assert not (tmp_path / "out").exists()
