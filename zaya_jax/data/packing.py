"""Packing document chunks into fixed-length training rows.

Shapes: L = the phase's sequence length, B = rows in a batch.

A *chunk* is a run of m <= L+1 consecutive tokens of one document; documents longer than
L+1 tokens are cut into chunks of L+1 that overlap by one token (`chunk_bounds`), so every
next-token target of the document lands in exactly one chunk. Packed, a chunk takes m-1
positions of a row: inputs = chunk[:-1], targets = chunk[1:]. Chunks are placed first-fit into
a window of `num_bins` rows; when a chunk fits in none of them, the window is emitted.

Row format (each [L]; batches stack them to [B, L]):
  inputs       int32    token ids; pad_id at padding
  targets      int32    the next token of the same document; pad_id at padding
  segment_ids  int32    0 = padding, 1..n = the row's chunks in order
  positions    int32    0.. within each chunk (restarts at 0 per segment); 0 at padding
  loss_mask    float32  1 where the target is a real next token of the same document
Every non-padding position has a real target (the chunk's last token is only a target),
so loss_mask == (segment_ids > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def chunk_bounds(num_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a document: at most seq_len+1 tokens, overlapping by one."""
    return [(s, min(s + seq_len + 1, num_tokens)) for s in range(0, num_tokens - 1, seq_len)]


class ChunkStream(Protocol):
    """A checkpointable stream of chunks (int32 [m], 2 <= m <= L+1); None when it is exhausted."""

    def next_chunk(self) -> np.ndarray | None: ...
    def get_state(self) -> Any: ...
    def set_state(self, state: Any) -> None: ...


def pack_window(stream: ChunkStream, seq_len: int, num_bins: int) -> list[list[np.ndarray]]:
    """Draws chunks first-fit into up to `num_bins` rows until one fits nowhere (it is put back).

    Returns the rows' chunk lists; fewer than num_bins rows only if the stream ran out.
    """
    rows: list[list[np.ndarray]] = []
    free: list[int] = []
    while True:
        before = stream.get_state()
        chunk = stream.next_chunk()
        if chunk is None:
            return rows
        need = len(chunk) - 1
        row = next((r for r in range(len(rows)) if free[r] >= need), None)
        if row is None:
            if len(rows) == num_bins:
                stream.set_state(before)
                return rows
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(chunk)
        free[row] -= need


def make_row(chunks: Sequence[np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed row (each array [L]) from chunks whose lengths minus one sum to <= L."""
    needed = sum(len(c) - 1 for c in chunks)
    if needed > seq_len:
        raise ValueError(f"chunks need {needed} positions, more than seq_len={seq_len}")
    inputs = np.full(seq_len, pad_id, np.int32)
    targets = np.full(seq_len, pad_id, np.int32)
    segment_ids = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    offset = 0
    for segment, chunk in enumerate(chunks, start=1):
        n = len(chunk) - 1
        inputs[offset:offset + n] = chunk[:-1]
        targets[offset:offset + n] = chunk[1:]
        segment_ids[offset:offset + n] = segment
        positions[offset:offset + n] = np.arange(n, dtype=np.int32)
        offset += n
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions,
            "loss_mask": (segment_ids > 0).astype(np.float32)}


def stack_rows(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """B rows of [L] -> a batch of [B, L] arrays."""
    return {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}


class RowPacker:
    """Rows from a chunk stream, packed a window at a time; its state is a small JSON-able dict.

    The state is the stream's state where the current window began plus how many of the window's
    rows were already returned: restoring re-packs that window and skips those rows.
    """

    def __init__(self, stream: ChunkStream, seq_len: int, num_bins: int, pad_id: int):
        self._stream, self._seq_len, self._num_bins, self._pad_id = stream, seq_len, num_bins, pad_id
        self._window_start = stream.get_state()
        self._rows: list[list[np.ndarray]] = []
        self._emitted = 0

    def next_row(self) -> dict[str, np.ndarray] | None:
        """The next row (arrays [L]), or None once a finite stream is exhausted."""
        if self._emitted == len(self._rows):
            self._window_start = self._stream.get_state()
            self._rows = pack_window(self._stream, self._seq_len, self._num_bins)
            self._emitted = 0
            if not self._rows:
                return None
        self._emitted += 1
        return make_row(self._rows[self._emitted - 1], self._seq_len, self._pad_id)

    def get_state(self) -> dict[str, Any]:
        return {"window": self._window_start, "emitted": self._emitted}

    def set_state(self, state: dict[str, Any]) -> None:
        self._stream.set_state(state["window"])
        self._window_start = state["window"]
        self._rows = pack_window(self._stream, self._seq_len, self._num_bins) if state["emitted"] else []
        self._emitted = state["emitted"]
