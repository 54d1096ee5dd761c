"""Documents into rows for pretraining, with the packing strategies of `fsdp_recipes.data.text` ("wrapped",
"bfd", `cross_document_attention`): `Packer` takes documents from a source and gives rows in which no document
attends to or predicts another, and holds what it has read but not placed, so a checkpoint can continue it exactly."""

from __future__ import annotations

from typing import Any

from fsdp_recipes.data import rows as rows_lib
from fsdp_recipes.data.rows import IGNORE_INDEX

PACKING_STRATEGIES = ("wrapped", "bfd")
_WINDOW_ROWS = 64  # bfd fits the documents of about this many rows at once: a larger window pads less, but holds more
# tokens in memory and is read again on resume


class _Row:
    def __init__(self):
        self.input_ids, self.targets, self.position_ids = [], [], []

    def __len__(self) -> int:
        return len(self.input_ids)

    def add(self, piece: list[int], following: list[int], *, continue_positions: bool = False) -> None:
        """`piece`: consecutive tokens; `following`: the token after it if it is still to be predicted, else []."""
        start = len(self.input_ids) if continue_positions else 0
        self.input_ids += piece
        self.targets += piece[1:] + (following[:1] or [IGNORE_INDEX])
        self.position_ids += range(start, start + len(piece))

    def build(self) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids, "targets": self.targets, "position_ids": self.position_ids}


class Packer:
    """Rows of at most `max_length` tokens from a document source (`next_document()`, None where a finite one ends;
    `state_dict()`/`load_state_dict()` for bfd, which re-reads its window on restore)."""

    def __init__(self, max_length: int, strategy: str = "wrapped", *, cross_document_attention: bool = False):
        self.max_length, self.strategy, self.cross_document = max_length, strategy, cross_document_attention
        self.pending: list[int] = []  # wrapped: tokens read but not yet placed
        self.window: list[dict] = []  # bfd: the rows of the current window ...
        self.window_start: Any = None  # ... the source's state before it was read ...
        self.emitted = 0  # ... and how many of its rows have been handed out
        self.documents_read = 0

    def next_row(self, source) -> dict[str, list[int]] | None:
        if self.strategy == "wrapped":
            return self._wrapped_row(source)
        if self.emitted == len(self.window):
            self._fill_window(source)
        if self.emitted == len(self.window):
            return None
        self.emitted += 1
        return self.window[self.emitted - 1]

    def _read(self, source) -> list[int] | None:
        document = source.next_document()
        self.documents_read += document is not None
        return document

    def _wrapped_row(self, source) -> dict[str, list[int]] | None:
        row = _Row()
        while len(row) < self.max_length:
            space = self.max_length - len(row)
            # across documents, the last token placed needs the token after it as target: read one token beyond
            while not self.pending or (self.cross_document and len(self.pending) <= space):
                document = self._read(source)
                if document is None:
                    break
                self.pending = self.pending + document
            if not self.pending:
                break
            piece, self.pending = self.pending[:space], self.pending[space:]
            row.add(piece, self.pending, continue_positions=self.cross_document)
        return row.build() if len(row) else None

    def _fill_window(self, source) -> None:
        self.window_start, self.emitted, pieces, tokens = source.state_dict(), 0, [], 0
        while tokens < _WINDOW_ROWS * self.max_length:
            document = self._read(source)
            if document is None:
                break
            tokens += len(document)
            for start in range(0, len(document), self.max_length):  # only a document longer than a row is cut
                end = start + self.max_length
                pieces.append((document[start:end], document[end : end + 1]))
        self.window = []
        for group in rows_lib.pack_lengths([len(piece) for piece, _ in pieces], self.max_length):
            row = _Row()
            for index in group:
                row.add(*pieces[index])
            self.window.append(row.build())

    def state_dict(self) -> dict:
        return {
            "pending": self.pending,
            "window_start": self.window_start,
            "emitted": self.emitted,
            "documents_read": self.documents_read,
        }

    def load_state_dict(self, state: dict, source) -> None:
        self.pending = list(state["pending"])
        if state["window_start"] is not None:  # read the window again: packing it is deterministic
            source.load_state_dict(state["window_start"])
            self._fill_window(source)
        self.emitted, self.documents_read = state["emitted"], state["documents_read"]
