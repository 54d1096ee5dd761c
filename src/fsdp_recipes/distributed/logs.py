"""Logging as the Hugging Face libraries do it: the recipes' lines go through `logging` (accelerate's `get_logger`,
main process only), at the config's `log_level`; on every process but each machine's main one, transformers and
datasets log errors only and datasets shows no progress bars, so a launch prints each bar and each line once.

`log_level` follows TrainingArguments: debug, info, warning, error, critical, or passive (info for these lines,
the libraries' own levels left as they are)."""

from __future__ import annotations

import ast
import contextlib
import logging
import sys

import datasets
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

NAME = "fsdp_recipes"
logger = get_logger(NAME)


class _ConsoleHandler(logging.Handler):
    """Each record as a plain line on the current stdout, written past any progress bar (tqdm.write)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # noqa: BLE001 - logging must never stop a run
            self.handleError(record)


def configure(accelerator: Accelerator, log_level: str) -> None:
    """Levels for this process: `log_level` on the machine's main process, warnings only elsewhere."""
    own = logging.getLogger(NAME)
    if not any(isinstance(handler, _ConsoleHandler) for handler in own.handlers):
        own.addHandler(_ConsoleHandler())
    own.propagate = False
    level = logging.INFO if log_level == "passive" else getattr(logging, log_level.upper())
    if accelerator.is_local_main_process:
        own.setLevel(level)
        datasets.enable_progress_bars()
        if log_level != "passive":
            transformers.utils.logging.set_verbosity(level)
            datasets.utils.logging.set_verbosity(level)
    else:
        own.setLevel(logging.WARNING)
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()


def info(message: str) -> None:
    logger.info(message, main_process_only=True)


def warning(message: str) -> None:
    logger.warning(message, main_process_only=True)


_SHARED_TENSOR_NOTICE = "Removed shared tensor "


@contextlib.contextmanager
def tied_copies_unannounced(models):
    """Within it, accelerate's notice that it wrote one of two tensors sharing memory (`Removed shared tensor
    {'lm_head.weight'} while saving. This should be OK, but check...`) is dropped when every tensor it names is a
    tie the models declare (tied embeddings): safetensors holds a storage once, and loading ties it again, which
    exact resume and the export's reload check. A shared tensor the models do not declare is still announced."""
    tied = {name for model in models for name in (getattr(model, "all_tied_weights_keys", None) or {})}

    def announced(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        start = message.find(_SHARED_TENSOR_NOTICE)
        if start < 0:
            return True
        try:
            names = ast.literal_eval(message[start + len(_SHARED_TENSOR_NOTICE) :].split(" while saving", 1)[0])
        except (ValueError, SyntaxError):
            return True
        return not all(any(name == key or name.endswith("." + key) for key in tied) for name in names)

    source = logging.getLogger("accelerate.utils.other")  # where accelerate's save cleans the state dict
    source.addFilter(announced)
    try:
        yield
    finally:
        source.removeFilter(announced)
