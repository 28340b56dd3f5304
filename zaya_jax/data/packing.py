"""Packing document chunks into fixed-length training rows.

Shapes: L = the phase's sequence length, B = rows in a batch.

A *chunk* is a run of m <= L+1 consecutive tokens of one document: int32 [m] for a text
document, int32 [2, m] (token ids, supervision mask) for a chat document. Documents longer than
L+1 tokens are cut along their last axis into chunks of L+1 that overlap by one token
(`chunk_bounds`), so every next-token target of the document lands in exactly one chunk.
Packed, a chunk takes m-1 positions of a row: inputs = ids[:-1], targets = ids[1:]. Chunks are
placed first-fit into a window of `num_bins` rows; when a chunk fits in none of them, the window
is emitted.

Row format (each [L]; batches stack them to [B, L]):
  inputs       int32    token ids; pad_id at padding
  targets      int32    the next token of the same document; pad_id at padding
  segment_ids  int32    0 = padding, 1..n = the row's chunks in order
  positions    int32    0.. within each chunk (restarts at 0 per segment); 0 at padding
  loss_mask    float32  text: 1 where the target is a real next token of the same document;
                        chat: the target token's mask (1 only on assistant tokens)
Every non-padding position has a real target (the chunk's last token is only a target),
so for text loss_mask == (segment_ids > 0).

What is packed is fixed by a `RowFormat`: `CHUNKS` (text and chat documents, above),
preference_rows.PAIRS (whole preference pairs, DPO rows) or vision.image_rows.ImageChatRows
(whole conversations with images; its rows also hold the images' patches, at most
`patch_capacity` per row); the packing itself is the same: a piece goes to the first row with
room for its positions and its patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def chunk_bounds(num_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a document: at most seq_len+1 tokens, overlapping by one."""
    return [(s, min(s + seq_len + 1, num_tokens)) for s in range(0, num_tokens - 1, seq_len)]


class RowFormat(Protocol):
    """How documents of one kind are cut into pieces (what packing places) and rows made of them.

    A piece takes between 1 and L positions of a row; `CHUNKS` cuts text and chat documents into
    chunks, preference_rows.PAIRS makes each preference document one whole pair.
    """

    def training_document(self, doc: Any, seed: int) -> Any:
        """`doc` as a training lane draws it, `seed` that draw's (lanes.LaneStream): ImageChatRows
        augments its images (vision.augment), the other formats return it; held-out streams never
        call this."""

    def document_positions(self, doc: np.ndarray, seq_len: int) -> int:
        """Row positions all pieces of `doc` take together; 0: the document yields no piece."""

    def next_piece(self, doc: np.ndarray, start: int, seq_len: int) -> tuple[Any, int | None]:
        """The piece of `doc` that begins at `start`, and where the next one begins (None: the last)."""

    def piece_positions(self, piece: Any) -> int:
        """Row positions `piece` takes."""

    patch_capacity: int  # image patches a row holds (0: a format without images)

    def piece_patches(self, piece: Any) -> int:
        """Image patches `piece` takes (0 without images)."""

    def make_row(self, pieces: Sequence[Any], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        """One row (each array [L]) from pieces whose positions sum to <= L."""


class ChunkRows:
    """The RowFormat of text ([n]) and chat ([2, n]) documents: chunks along the last axis."""

    @staticmethod
    def training_document(doc: np.ndarray, seed: int) -> np.ndarray:
        del seed
        return doc

    @staticmethod
    def document_positions(doc: np.ndarray, seq_len: int) -> int:
        del seq_len
        return doc.shape[-1] - 1 if doc.shape[-1] >= 2 else 0  # a document needs two tokens to hold a target

    @staticmethod
    def next_piece(doc: np.ndarray, start: int, seq_len: int) -> tuple[np.ndarray, int | None]:
        end = min(start + seq_len + 1, doc.shape[-1])
        return doc[..., start:end], (start + seq_len if end < doc.shape[-1] else None)

    @staticmethod
    def piece_positions(piece: np.ndarray) -> int:
        return piece.shape[-1] - 1

    patch_capacity = 0

    @staticmethod
    def piece_patches(piece: np.ndarray) -> int:
        del piece
        return 0

    @staticmethod
    def make_row(pieces: Sequence[np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        return make_row(pieces, seq_len, pad_id)


CHUNKS = ChunkRows()


class ChunkStream(Protocol):
    """A checkpointable stream of pieces (a RowFormat's; for CHUNKS int32 [m] or [2, m], 2 <= m <= L+1);
    next_chunk returns None when the stream is exhausted."""

    def next_chunk(self) -> Any: ...
    def get_state(self) -> Any: ...
    def set_state(self, state: Any) -> None: ...


def pack_window(stream: ChunkStream, seq_len: int, num_bins: int,
                row_format: RowFormat = CHUNKS) -> list[list[Any]]:
    """Draws pieces first-fit into up to `num_bins` rows until one fits nowhere (it is put back).

    Returns the rows' piece lists; fewer than num_bins rows only if the stream ran out.
    """
    rows: list[list[Any]] = []
    free: list[list[int]] = []  # per row: positions, patches
    while True:
        before = stream.get_state()
        chunk = stream.next_chunk()
        if chunk is None:
            return rows
        need = (row_format.piece_positions(chunk), row_format.piece_patches(chunk))
        row = next((r for r in range(len(rows)) if free[r][0] >= need[0] and free[r][1] >= need[1]), None)
        if row is None:
            if len(rows) == num_bins:
                stream.set_state(before)
                return rows
            rows.append([])
            free.append([seq_len, row_format.patch_capacity])
            row = len(rows) - 1
        rows[row].append(chunk)
        free[row] = [free[row][0] - need[0], free[row][1] - need[1]]


def make_row(chunks: Sequence[np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed row (each array [L]) from chunks ([m] text or [2, m] ids+mask) whose lengths
    minus one sum to <= L. A [2, m] chunk's loss_mask is the mask of each target token."""
    needed = sum(c.shape[-1] - 1 for c in chunks)
    if needed > seq_len:
        raise ValueError(f"chunks need {needed} positions, more than seq_len={seq_len}")
    inputs = np.full(seq_len, pad_id, np.int32)
    targets = np.full(seq_len, pad_id, np.int32)
    segment_ids = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    loss_mask = np.zeros(seq_len, np.float32)
    offset = 0
    for segment, chunk in enumerate(chunks, start=1):
        ids = chunk if chunk.ndim == 1 else chunk[0]
        n = len(ids) - 1
        inputs[offset:offset + n] = ids[:-1]
        targets[offset:offset + n] = ids[1:]
        segment_ids[offset:offset + n] = segment
        positions[offset:offset + n] = np.arange(n, dtype=np.int32)
        loss_mask[offset:offset + n] = 1 if chunk.ndim == 1 else chunk[1, 1:]
        offset += n
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions,
            "loss_mask": loss_mask}


def stack_rows(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """B rows of [L] (and [P, ...] image patches) -> a batch of [B, L] (and [B, P, ...]) arrays."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class RowPacker:
    """Rows from a piece stream, packed a window at a time; its state is a small JSON-able dict.

    The state is the stream's state where the current window began plus how many of the window's
    rows were already returned: restoring re-packs that window and skips those rows.
    `row_format` must be the one that cut the stream's pieces.
    """

    def __init__(self, stream: ChunkStream, seq_len: int, num_bins: int, pad_id: int,
                 row_format: RowFormat = CHUNKS):
        self._stream, self._seq_len, self._num_bins, self._pad_id = stream, seq_len, num_bins, pad_id
        self._format = row_format
        self._window_start = stream.get_state()
        self._rows: list[list[Any]] = []
        self._emitted = 0

    def next_row(self) -> dict[str, np.ndarray] | None:
        """The next row (arrays [L]), or None once a finite stream is exhausted."""
        if self._emitted == len(self._rows):
            self._window_start = self._stream.get_state()
            self._rows = pack_window(self._stream, self._seq_len, self._num_bins, self._format)
            self._emitted = 0
            if not self._rows:
                return None
        self._emitted += 1
        return self._format.make_row(self._rows[self._emitted - 1], self._seq_len, self._pad_id)

    def get_state(self) -> dict[str, Any]:
        return {"window": self._window_start, "emitted": self._emitted}

    def set_state(self, state: dict[str, Any]) -> None:
        self._stream.set_state(state["window"])
        self._window_start = state["window"]
        self._rows = (pack_window(self._stream, self._seq_len, self._num_bins, self._format)
                      if state["emitted"] else [])
        self._emitted = state["emitted"]
