"""Steps that read the user's input, and the translation of what libraries raise there into one message.

A step that reads something the user named (a model folder or Hub id, a data file, a column) runs inside
`step(what, name=..., setting=...)`. An exception a library raises inside it because of that input (the Hub
unreachable, a path that does not exist and so was taken for a Hub id, a binary file read as text, a column of chat
turns given to the tokenizer as text) becomes an `InputError`: one message naming the step, the input and the fix, which
the recipe's boundary (`errors.exit_on_user_error`) prints as its `error:` line. Anything the step does not recognise
is a bug: it passes unchanged, with a note naming the step, and the boundary shows its traceback.

    with steps.step(f"loading the tokenizer from {name!r}", name=name, setting="tokenizer_name_or_path"):
        tokenizer = AutoTokenizer.from_pretrained(name)

The recognisers below know the exceptions of huggingface_hub, transformers, the file system and decoding; a step may
add its own reading (`explain`), e.g. which file of a folder is not UTF-8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from fsdp_recipes.common.errors import InputError, UserError

# `name` or `org/name`, as the Hub spells repository ids; anything else can only be meant as a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


@dataclasses.dataclass(frozen=True)
class Problem:
    """What was wrong with the input (`text`) and what to do about it (`fix`, a sentence)."""

    text: str
    fix: str


@dataclasses.dataclass(frozen=True)
class Step:
    what: str  # what was being done, naming the input: "loading the tokenizer from 'org/name'"
    name: str | None = None  # the input itself: a path, a Hub id, a column
    setting: str | None = None  # the config field that names it, for the fix
    explain: Callable[[BaseException, Step], Problem | None] | None = None  # the step's own reading of an exception

    def point_elsewhere(self, kind: str = "another one") -> str:
        """ "point <setting> at <kind>", for the fixes."""
        return f"point {self.setting} at {kind}" if self.setting else f"give {kind}"


@contextlib.contextmanager
def step(
    what: str,
    *,
    name: str | None = None,
    setting: str | None = None,
    explain: Callable[[BaseException, Step], Problem | None] | None = None,
    met_by_one_rank: bool = False,
) -> Iterator[Step]:
    """Runs the block as the named step: a library exception caused by the input becomes an InputError naming the step,
    the input and the fix; a UserError passes as it is; anything else passes with a note naming the step (a bug).
    `met_by_one_rank`: a step each rank runs on its own input (its part of a stream), whose error that rank reports
    itself rather than the main rank for all."""
    current = Step(what, name=name, setting=setting, explain=explain)
    try:
        yield current
    except UserError:
        raise
    except Exception as error:
        translated = user_error_from(error, current)
        if translated is None:
            error.add_note(f"(while {what})")
            raise
        if met_by_one_rank:
            translated.reported_by_main_rank = False
        raise translated from None


def user_error_from(error: BaseException, current: Step) -> UserError | None:
    """`error` met during `current` as the user's error, or None when it is not one (a bug)."""
    if isinstance(error, UserError):
        return error
    problem = (current.explain(error, current) if current.explain else None) or recognise(error, current)
    if problem is None:
        return None
    return InputError(f"{current.what}: {problem.text}. {problem.fix}")


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the exceptions it was raised from or while handling, outermost first."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def recognise(error: BaseException, current: Step) -> Problem | None:
    """The input problem behind a library's exception: the Hub, the file system, decoding, the tokenizer. Each
    recogniser reads one exception of the chain (`outer`: the whole of it, for context such as a file's name)."""
    errors = list(chain(error))
    for recogniser in _RECOGNISERS:
        for one in errors:
            problem = recogniser(one, current, error)
            if problem is not None:
                return problem
    return None


@functools.cache
def _hub():
    """huggingface_hub's exception classes, and those of the HTTP client it uses (httpx2 for huggingface_hub 2, httpx
    before): matched by type, so a renamed class fails at import in the tests rather than going unrecognised."""
    import importlib

    from huggingface_hub import errors

    http_error = getattr(errors, "HTTPError", None)  # the client's own base class, which huggingface_hub re-exports
    client = importlib.import_module(http_error.__module__.split(".")[0]) if http_error else None
    transport = (client.ConnectError, client.TimeoutException) if client else ()
    return errors, (ConnectionError, TimeoutError, socket.gaierror, *transport)


def _no_local_path(current: Step) -> str:
    """', and there is no local folder 'x' either' when the name could have been meant as a relative path."""
    if current.name and "/" in current.name and not Path(current.name).expanduser().exists():
        return f" (and there is no local folder {current.name!r} either: {Path(current.name).absolute()})"
    return ""


def _not_a_path_nor_a_hub_id(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    if not isinstance(error, _hub()[0].HFValidationError):
        return None
    where = Path(current.name).expanduser().absolute() if current.name else "it"
    return Problem(
        f"there is no such local path ({where}), and it cannot be a Hub id either (those look like org/name)",
        f"Fix the path (a relative path starts from {Path.cwd()}), or "
        f"{current.point_elsewhere('an existing folder or a Hub id')}",
    )


def _hub_unreachable(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    hub = _hub()[0]
    if not isinstance(error, hub.OfflineModeIsEnabled | hub.LocalEntryNotFoundError):
        return None
    from huggingface_hub import constants

    local = f", or {current.point_elsewhere('a local folder')}"
    if constants.HF_HUB_OFFLINE:
        return Problem(
            f"it is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set, so the Hub was not "
            f"asked{_no_local_path(current)}",
            f"Unset HF_HUB_OFFLINE where the Hub can be reached{local}",
        )
    reason = next((f"{type(e).__name__}: {e}" for e in chain(error) if _is_connection_error(e)), None)
    return Problem(
        f"the Hugging Face Hub could not be reached{f' ({reason})' if reason else ''} and it is not in the "
        f"local cache{_no_local_path(current)}",
        f"Check the network and the id (a copy downloaded before loads with HF_HUB_OFFLINE=1){local}",
    )


def _is_connection_error(error: BaseException) -> bool:
    return isinstance(error, _hub()[1])


def _hub_refused(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    hub = _hub()[0]
    if isinstance(error, hub.GatedRepoError):
        return Problem(
            "the Hub repository is gated",
            "Accept its terms on its Hub page, then log in with `hf auth "
            f"login` or set HF_TOKEN; or {current.point_elsewhere()}",
        )
    if isinstance(error, hub.RepositoryNotFoundError):
        return Problem(
            f"the Hub has no such repository, or it is private{_no_local_path(current)}",
            "Check the id (org/name); if it is private, log in with `hf auth login` or set HF_TOKEN; or "
            f"{current.point_elsewhere()}",
        )
    if isinstance(error, hub.RevisionNotFoundError):
        return Problem(
            "the Hub repository has no such revision (branch, tag or commit)",
            "Set model_revision to one it has (main is the default)",
        )
    if isinstance(error, hub.HfHubHTTPError):
        return Problem(
            f"the Hub refused the request ({' '.join(str(error).split())[:200]})",
            f"Check the id and your token (`hf auth login` or HF_TOKEN), or {current.point_elsewhere()}",
        )
    if _is_connection_error(error):
        return Problem(
            f"the Hugging Face Hub could not be reached ({type(error).__name__}: {error})",
            f"Check the network (a copy downloaded before loads with HF_HUB_OFFLINE=1), or "
            f"{current.point_elsewhere('a local folder')}",
        )
    return None


def _not_text(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    if not isinstance(error, UnicodeDecodeError):
        return None
    return Problem(
        f"it is not UTF-8 text ({error.reason} at byte {error.start}: a binary file?)",
        f"Convert it to UTF-8 text, or {current.point_elsewhere()}",
    )


def _file_system(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    hub = _hub()[0]
    if not isinstance(error, OSError) or isinstance(error, hub.HfHubHTTPError | hub.EntryNotFoundError):
        return None
    where = error.filename or current.name
    if isinstance(error, PermissionError):
        return Problem(f"permission denied reading {where}", f"Make it readable, or {current.point_elsewhere()}")
    if isinstance(error, (FileNotFoundError, NotADirectoryError)) and error.filename:
        return Problem(f"there is no {where}", f"Fix the path, or {current.point_elsewhere()}")
    if isinstance(error, IsADirectoryError):
        return Problem(
            f"{where} is a folder where a file was expected", f"Name the file, or {current.point_elsewhere()}"
        )
    return None


def _not_json(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    if not isinstance(error, json.JSONDecodeError):
        return None
    # transformers names the file in the exception it raises from this one ("the config file at '...'")
    named = next((found.group(1) for e in chain(outer) if (found := re.search(r" at '([^']+)'", str(e)))), None)
    return Problem(
        f"{named or 'a JSON file in it'} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})",
        f"Fix the file, or {current.point_elsewhere()}",
    )


# transformers raises a plain ValueError here: only its message tells (pinned against the installed version by
# tests/test_data_errors.py::test_the_tokenizer_message_the_step_recognises_is_the_installed_ones)
TOKENIZER_NON_TEXT = "text input must be of type `str`"


def _tokenizer_given_non_text(error: BaseException, current: Step, outer: BaseException) -> Problem | None:
    if not (isinstance(error, ValueError) and str(error).startswith(TOKENIZER_NON_TEXT)):
        return None
    return Problem(
        "its values are not text (the tokenizer takes strings)",
        f"{current.point_elsewhere('a column of strings').capitalize()}",
    )


_RECOGNISERS = (
    _not_a_path_nor_a_hub_id,
    _hub_unreachable,
    _hub_refused,
    _not_text,
    _not_json,
    _file_system,
    _tokenizer_given_non_text,
)
