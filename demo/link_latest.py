#!/usr/bin/env python
"""Points `latest` beside a run folder at it, as `make demo` does after a successful run, so that the next demo's
`model_name_or_path: outputs/demo_reverse/latest` finds the model it just exported.

    python demo/link_latest.py --check outputs/demo_reverse/20261203-170254   # before the run: may latest be replaced?
    python demo/link_latest.py outputs/demo_reverse/20261203-170254           # after it: latest -> 20261203-170254

`latest` is a relative symbolic link (the outputs folder can be moved), replaced atomically: the new link is made
under a temporary name and renamed over the old one, so `latest` always names a whole run. A `latest` that is a real
folder (the SFT demo config run as it is, without --output_dir, writes there) is left alone and refused before the run.
Standard library only: the Makefile runs it before anything is trained.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

LATEST = "latest"


def problem(run: Path, *, check_only: bool) -> str | None:
    """Why `latest` cannot be pointed at `run`, or None."""
    latest = run.parent / LATEST
    if os.path.lexists(latest) and not latest.is_symlink():
        return (
            f"{latest} is a folder, not the link `make demo` keeps (running the SFT demo config without "
            f"--output_dir writes there): move it (mv {latest} {run.parent}/<a name>) and run make demo again"
        )
    if not check_only and not (run / "config.json").is_file():
        return f"{run} holds no exported model (no config.json): {latest} is left as it was"
    return None


def point_latest_at(run: Path) -> Path:
    """`run`'s sibling `latest` -> run's name, replacing any previous link atomically."""
    latest = run.parent / LATEST
    staging = run.parent / f".{LATEST}-{os.getpid()}"
    if os.path.lexists(staging):
        staging.unlink()
    os.symlink(run.name, staging)
    os.replace(staging, latest)  # rename(2): atomic, and it replaces a link (never a folder)
    return latest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run folder (its parent holds `latest`)")
    parser.add_argument("--check", action="store_true", help="only say whether latest could be replaced")
    args = parser.parse_args(argv)
    run = Path(os.path.normpath(args.run))
    found = problem(run, check_only=args.check)
    if found:
        print(f"error: {found}", file=sys.stderr)
        return 2
    if not args.check:
        print(f"{point_latest_at(run)} -> {run.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
