"""Errors a user can fix, and how a recipe reports them: one message naming the problem and the fix, a nonzero
exit, no traceback, printed once rather than by every rank. A library's exception caused by the user's input becomes
one of them where the step that met it is named (`fsdp_recipes.common.steps`); any other exception is a bug, shown
with its traceback once, on the rank that hit it, with a line saying so."""

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


class NonFiniteError(UserError, ArithmeticError):
    """A training figure that is not a finite number (the gradient norm of a step, a reward): the run stops there,
    on every rank, before the update reaches the weights."""


PREEMPTED_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: a temporary failure, to be tried again


class Preempted(Exception):
    """A preemption signal reached a rank: every rank finished the step and saved a checkpoint together; the run
    stops with PREEMPTED_EXIT_CODE, and the same command started again resumes from that checkpoint."""


class InputError(UserError):
    """A library's exception (the Hub, a file, a tokenizer) caused by the user's input, translated by the step that met
    it (`fsdp_recipes.common.steps.step`): the step, the input and the fix."""


class PeerRankFailed(UserError):
    """Another rank failed in a step every rank runs together; this one stops with it instead of waiting in a
    collective. `bug`: the other rank's failure was not the user's error (its traceback is printed there)."""

    def __init__(self, message: str, *, bug: bool = False):
        super().__init__(message)
        self.bug = bug


class DiskFullError(UserError, OSError):
    """A write ran out of disk space (or quota): the message says where, how much is free and how much was needed."""

    def __init__(self, message: str, *, reported_by_main_rank: bool = True):
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.reported_by_main_rank = reported_by_main_rank


def is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


BUG_NOTE = (
    "This is a bug in FSDP Recipes or in a library it uses, not a problem with your input: please report it, "
    "with the traceback above and the command that ran."
)


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Runs `main`, the recipe's boundary: a UserError becomes `error: <message>` on stderr (main rank only) and exit
    status 2; a preemption, `preempted: <where it saved>` and PREEMPTED_EXIT_CODE; any other exception is a bug, re-raised (its traceback printed once, by the rank that hit it) with a
    last line saying so; a rank stopped by another rank's bug prints one line and exits 1."""
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except Preempted as stop:
        _close_progress_bars()
        if is_main_rank():
            print(f"preempted: {stop}", file=sys.stderr, flush=True)
        _destroy_process_group()
        sys.exit(PREEMPTED_EXIT_CODE)
    except UserError as error:
        if isinstance(error, PeerRankFailed) and error.bug:  # one line: the traceback is the failing rank's to show
            print(f"rank {rank}: stopping because {error}", file=sys.stderr, flush=True)
            _destroy_process_group()
            sys.exit(PEER_FAILURE_EXIT_CODE)
        _report_user_error(error)
    except Exception as error:
        if not _is_peer_failure(error):
            if not getattr(error, "deliberate", False):  # FSDP_RECIPES_FAULT's own errors are no bug
                error.add_note(BUG_NOTE)
            raise
        # The failing rank prints its own error; repeating it here as a second traceback would only bury it.
        print(f"rank {rank}: stopping because another process failed (its error is above)", file=sys.stderr, flush=True)
        sys.exit(PEER_FAILURE_EXIT_CODE)


def _report_user_error(error: UserError) -> None:
    """`error: <message>` (once: by the main rank, or by the rank that met it alone), exit status 2. A progress bar
    left open (an error met inside the loop) is closed first, so that the message starts a line of its own."""
    _close_progress_bars()
    if is_main_rank():
        print(f"error: {error}", file=sys.stderr, flush=True)
    elif not error.reported_by_main_rank:
        print(f"error: rank {os.environ.get('RANK')}: {error}", file=sys.stderr, flush=True)
    _destroy_process_group()
    sys.exit(USER_ERROR_EXIT_CODE)


def _close_progress_bars() -> None:
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


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
