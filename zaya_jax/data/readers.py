"""Raw input readers: text, jsonl and parquet files -> documents (strings) or records (fields).

Formats:
  text     each file is one document (UTF-8).
  jsonl    one JSON object per line; the document is its `text_field` (blank lines are ignored).
  parquet  one document per row, from the string column `text_field` (needs pyarrow).

`read_records` reads several typed fields of each line / row instead (chat `messages` lists,
preference `prompt` / `chosen` / `rejected`); a field that is missing or of another type is a bad
line, named like any other.

Every problem with an input names the file and, where one exists, the line (the row for
parquet) in an `InputError`. Readers either raise it or, given `on_error`, report it and go on:
a bad line is skipped, a bad file (unreadable, empty, not parquet) ends that file.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
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


class Record(NamedTuple):
    """The fields of one jsonl line / parquet row; `offset` as for Document."""

    line: int
    values: dict
    offset: int


Fields = Mapping[str, tuple[type, ...]]  # field name -> the types its value may have


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
    for record in read_records(path, fmt, {text_field: (str,)}, on_error):
        yield Document(record.line, record.values[text_field], record.offset)


def read_records(path: str, fmt: str, fields: Fields, on_error: ErrorHandler = raise_error) -> Iterator[Record]:
    """Yields the `fields` of each line / row of one input file (all required, of their types);
    problems go to `on_error`. The text format holds one string field: the whole file."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    reader = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}[fmt]
    try:
        yield from reader(path, fields, on_error)
    except OSError as e:
        on_error(InputError(path, None, f"cannot read file: {e.strerror or e}"))


def _type_names(types: tuple[type, ...]) -> str:
    names = {str: "string", list: "list", dict: "object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _read_text(path: str, fields: Fields, on_error: ErrorHandler) -> Iterator[Record]:
    (field, types), = fields.items()
    assert types == (str,), "the text format holds one string per file"
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
    yield Record(1, {field: text}, len(data))


def _read_jsonl(path: str, fields: Fields, on_error: ErrorHandler) -> Iterator[Record]:
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
            if not isinstance(record, dict):
                record = {}
            bad = next((name for name, types in fields.items() if not isinstance(record.get(name), types)), None)
            if bad is not None:
                on_error(InputError(path, number, f"no {_type_names(fields[bad])} field {bad!r} in this JSON line"))
                continue
            yield Record(number, {name: record[name] for name in fields}, offset)
    if not found:
        on_error(InputError(path, None, "empty file (no JSON lines)"))


def _read_parquet(path: str, fields: Fields, on_error: ErrorHandler) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("--format parquet needs pyarrow: pip install pyarrow") from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for non-parquet files
        on_error(InputError(path, None, f"not a readable parquet file: {e}"))
        return
    missing = [name for name in fields if name not in parquet.schema_arrow.names]
    if missing:
        on_error(InputError(path, None, f"no column {missing[0]!r} (columns: {parquet.schema_arrow.names})"))
        return
    total_rows, size = parquet.metadata.num_rows, os.path.getsize(path)
    if total_rows == 0:
        on_error(InputError(path, None, "empty file (no rows)"))
        return
    row = 0
    for batch in parquet.iter_batches(columns=list(fields)):
        for values in batch.to_pylist():
            row += 1
            bad = next((name for name, types in fields.items() if not isinstance(values[name], types)), None)
            if bad is not None:
                on_error(InputError(path, row, f"column {bad!r} is not a {_type_names(fields[bad])} in this row"))
                continue
            yield Record(row, values, size * row // total_rows)
