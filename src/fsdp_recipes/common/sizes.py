"""Sizes in bytes, the one way every command reads and writes them: `80GB` (decimal), `141GiB` (binary), `24e9`."""

from __future__ import annotations

import re

from fsdp_recipes.common.errors import ConfigError

MIB = 2**20
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, *, minimum: int = MIB) -> int:
    """'80GB' -> 80e9, '141GiB' -> 141 * 2**30, '24e9' -> 24e9 bytes. GB/MB are decimal, GiB/MiB binary, a bare
    number is bytes. Below `minimum` bytes is refused: for memory sizes (the default, 1 MiB) a bare '80' is far more
    likely to mean 80GB than 80 bytes. Raises ConfigError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"cannot read memory size {text!r}: write a number with a unit, e.g. 80GB, 141GiB, 24e9 (bytes)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size < minimum:
        if minimum == MIB:
            raise ConfigError(f"memory size {text!r} is under 1 MiB; did you mean {text}GB?")
        raise ConfigError(f"size {text!r} is under {minimum} bytes")
    return size


def parse_reserve(text: str, gpu_memory: int) -> int:
    """Memory kept free on a GPU of `gpu_memory` bytes: '10%' of it, a size ('4GiB'), or 0."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100
        except ValueError:
            fraction = -1
        if not 0 <= fraction < 1:
            raise ConfigError(f"--reserve {text!r}: a percentage must be between 0% and 100%")
        return int(gpu_memory * fraction)
    if text in ("0", "0B", "0GB", "0GiB"):
        return 0
    size = parse_size(text)
    if size >= gpu_memory:
        raise ConfigError(f"--reserve {text!r} is not smaller than --gpu-memory")
    return size


def gib(n: float) -> str:
    """Bytes as '12.34 GiB'."""
    return f"{n / 2**30:.2f} GiB"


def short_size(n: float) -> str:
    """Bytes as '12.3 GiB', or '456 MiB' under 1 GiB (the width of a table column)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
