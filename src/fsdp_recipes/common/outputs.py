"""The output folder: refused before training if writing there would replace someone's files or cannot work."""

from __future__ import annotations

import tempfile
from pathlib import Path


def output_dir_problem(output_dir: str | Path, *, overwrite: bool) -> str | None:
    """None if training may write to `output_dir`, else what is wrong and how to fix it."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        return f"output_dir {str(path)!r} is a file, not a folder: choose another output_dir"
    if path.is_dir() and not overwrite:
        existing = sorted(child.name for child in path.iterdir())
        if existing:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            return (
                f"output_dir {str(path)!r} is not empty (it holds {shown}); refusing to overwrite it. Choose a new "
                "output_dir, or pass --overwrite_output_dir true to write into it anyway."
            )
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as error:
        return f"output_dir {str(path)!r} cannot be written ({ancestor}: {error.strerror}): choose another output_dir"
    return None
