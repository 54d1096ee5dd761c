"""Whether a run compiles its decoder layers: `torch_compile` true or false as written, or `auto`, decided by the
device and the run's length, with the reason for the run summary."""

from __future__ import annotations

from fsdp_recipes.common.errors import ConfigError

# Compile pays back its start-up pause only over enough steps. The one GPU run (docs/gpu.md: 1.1B model, one H200)
# saved 0.10 s a step (0.291 -> 0.188 s); a start-up pause of about 30 s for regional compilation (one layer compiled,
# the others reuse it) is then repaid after ~300 steps. The start-up itself is measured by the GPU check
# (first_step_time_s with and without compile) when a GPU is lent; until then this is an estimate.
COMPILE_REPAID_AFTER_STEPS = 300


CHOICES = ("true", "false", "auto")


def compile_setting_problem(name: str, value) -> str | None:
    """`torch_compile` is TrainingArguments' boolean, written true/false in YAML or on the command line, or auto."""
    if str(value).lower() in CHOICES:
        return None
    return f"{name} {value!r} is not one of true, false, auto"


def compile_choice(torch_compile, *, device_type: str, max_steps: int, sequence_parallel: int = 1) -> tuple[bool, str]:
    """(compile the layers?, why) for the run summary. ConfigError for `true` under sequence parallelism: its
    attention runs outside compiled regions, and each batch's examples would be guarded into a new graph."""
    setting = str(torch_compile).lower()
    if sequence_parallel > 1:
        if setting == "true":
            raise ConfigError(
                f"torch_compile: true under sequence parallelism (sp {sequence_parallel}): the split attention runs "
                "outside compiled regions and each batch would recompile the layers; set torch_compile: false (or auto)"
            )
        return False, f"off (sequence parallelism, sp {sequence_parallel}: its attention is not compiled)"
    if setting == "true":
        return True, "on (torch_compile: true)"
    if setting != "auto":
        return False, "off (torch_compile: false)"
    if device_type != "cuda":
        return False, (
            f"off (auto: the device is {device_type}; compiled steps there are not faster and compiling takes minutes)"
        )
    if 0 < max_steps < COMPILE_REPAID_AFTER_STEPS:
        return False, (
            f"off (auto: max_steps {max_steps} is under the ~{COMPILE_REPAID_AFTER_STEPS} steps that repay the "
            "compile pause)"
        )
    return True, (
        f"on (auto: a CUDA device and a run of at least ~{COMPILE_REPAID_AFTER_STEPS} steps or of epochs; the pause "
        "is in first_step_time_s)"
    )
