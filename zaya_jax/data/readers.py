"""Raw input readers: text, jsonl and parquet files -> documents (strings).

Formats:
  text     each file is one document (UTF-8).
  jsonl    one JSON object per line; the document is its `text_field` (blank lines are ignored).
  parquet  one document per row, from the string column `text_field` (needs pyarrow).

Every problem with an input names the file and, where one exists, the line (the row for
parquet) in an `InputError`. Readers either raise it or, given `on_error`, report it and go on:
a bad line is skipped, a bad file (unreadable, empty, not parquet) ends that file.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from zaya_jax.errors import UserError

FORMATS = ("text", "jsonl", "parquet")


class InputError(UserError, ValueError):
    """A bad input file. `line` is 1-based (the row number for parquet), or None for the file."""

    def __init__(self, path: str, line: int | None, reason: str):
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):  # picklable across worker processes
        return InputError, (self.path, self.line, self.reason)


class Document(NamedTuple):
    """One document read from `path`; `offset` is how many bytes of the file are consumed."""

    line: int
    text: str
    offset: int


ErrorHandler = Callable[[InputError], None]


def raise_error(error: InputError) -> None:
    """The default error handler: raise."""
    raise error


def expand_inputs(patterns: str | Sequence[str]) -> list[str]:
    """Sorted, de-duplicated files matching the glob patterns (`**` recurses).

    Raises FileNotFoundError naming a pattern that matches no file.
    """
    files: set[str] = set()
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matched:
            raise FileNotFoundError(f"--input pattern {pattern!r} matches no file")
        files.update(os.path.abspath(p) for p in matched)
    return sorted(files)


def read_documents(path: str, fmt: str, text_field: str = "text",
                   on_error: ErrorHandler = raise_error) -> Iterator[Document]:
    """Yields the documents of one input file; problems go to `on_error` (default: raise)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    reader = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}[fmt]
    try:
        yield from reader(path, text_field, on_error)
    except OSError as e:
        on_error(InputError(path, None, f"cannot read file: {e.strerror or e}"))


def _read_text(path: str, text_field: str, on_error: ErrorHandler) -> Iterator[Document]:
    del text_field
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        on_error(InputError(path, line, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
        return
    if not text.strip():
        on_error(InputError(path, None, "empty file"))
        return
    yield Document(1, text, len(data))


def _read_jsonl(path: str, text_field: str, on_error: ErrorHandler) -> Iterator[Document]:
    offset, found = 0, False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            offset += len(raw)
            if not raw.strip():
                continue
            found = True
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                on_error(InputError(path, number, f"malformed JSON: {e}"))
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                on_error(InputError(path, number, f"no string field {text_field!r} in this JSON line"))
                continue
            yield Document(number, text, offset)
    if not found:
        on_error(InputError(path, None, "empty file (no JSON lines)"))


def _read_parquet(path: str, text_field: str, on_error: ErrorHandler) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("--format parquet needs pyarrow: pip install pyarrow") from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for non-parquet files
        on_error(InputError(path, None, f"not a readable parquet file: {e}"))
        return
    if text_field not in parquet.schema_arrow.names:
        on_error(InputError(path, None, f"no column {text_field!r} (columns: {parquet.schema_arrow.names})"))
        return
    total_rows, size = parquet.metadata.num_rows, os.path.getsize(path)
    if total_rows == 0:
        on_error(InputError(path, None, "empty file (no rows)"))
        return
    row = 0
    for batch in parquet.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                on_error(InputError(path, row, f"column {text_field!r} is not a string in this row"))
                continue
            yield Document(row, text, size * row // total_rows)
