"""Errors a user can fix, and how a recipe reports them: one message naming the problem and the fix, a nonzero
exit, no traceback, printed once rather than by every rank."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

USER_ERROR_EXIT_CODE = 2
PEER_FAILURE_EXIT_CODE = 1


class UserError(Exception):
    """Bad input or setup, as opposed to a bug: reported without a traceback."""

    # Most are found by checks that every rank runs on the same inputs, so the main rank reports them for all. An
    # error that only some ranks may meet (their own writes to a full disk) clears this, so a rank that meets it
    # alone still says why it stopped.
    reported_by_main_rank = True


class ConfigError(UserError, ValueError):
    """A problem in the recipe config or command line; several are reported together."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class DataError(UserError, ValueError):
    """A problem with the dataset."""


class DistributedSetupError(UserError, RuntimeError):
    """The launch cannot give the training that was asked for."""


class DiskFullError(UserError, OSError):
    """A write ran out of disk space (or quota): the message says where, how much is free and how much was needed."""

    def __init__(self, message: str, *, reported_by_main_rank: bool = True):
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.reported_by_main_rank = reported_by_main_rank


def is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Runs `main`; a UserError becomes `error: <message>` on stderr (main rank only) and exit status 2."""
    try:
        main()
    except UserError as error:
        if is_main_rank():
            print(f"error: {error}", file=sys.stderr, flush=True)
        elif not error.reported_by_main_rank:
            print(f"error: rank {os.environ.get('RANK')}: {error}", file=sys.stderr, flush=True)
        _destroy_process_group()
        sys.exit(USER_ERROR_EXIT_CODE)
    except Exception as error:
        if not _is_peer_failure(error):
            raise
        # The failing rank prints its own error; repeating it here as a second traceback would only bury it.
        rank = os.environ.get("RANK", "0")
        print(f"rank {rank}: stopping because another process failed (its error is above)", file=sys.stderr, flush=True)
        sys.exit(PEER_FAILURE_EXIT_CODE)


_PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "remote worker crash")


def _is_peer_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in _PEER_FAILURE_SIGNS)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
