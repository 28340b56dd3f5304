"""Chunk streams: where each row of a batch gets its documents.

A global batch of B rows is fed by B independent *lanes*; row r of every batch comes from
lane r. A lane depends only on (seed, phase, r, B), never on how many processes or workers
there are, so process p of n can compute just its lanes [p*B/n, (p+1)*B/n) and still produce
exactly its slice of the batch a single process would produce.

Within a lane (`LaneStream`):
  * each source s is read in the order of an endless seeded shuffle Sigma_s (a fresh
    permutation per epoch); lane r of B takes Sigma_s[r], Sigma_s[r + B], ... so the B lanes
    split each epoch between them without overlap;
  * the next document comes from the source furthest behind its share of the lane's target
    tokens (mixture weights are fractions of training tokens, met to within one document);
  * each document drawn is the format's training_document of it, seeded by (the source's
    seed, the epoch, the document): image_chat rows augment its images there (vision/augment.py),
    anew each epoch; other formats take it as stored;
  * documents are cut into pieces by the phase's packing.RowFormat: text and chat documents
    into chunks of at most L+1 tokens (packing.chunk_bounds), preference documents into one
    whole (fitted) pair each (preference_rows.PAIRS). "Tokens" are the row positions the
    pieces take (for text and chat: the document's targets).
The state is a few integers per source, so it is cheap to save and exact to restore.

`SequentialStream` reads one source once, in order (the held-out evaluation stream), every
document as stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zaya_jax.data import packing
from zaya_jax.data.sources import DocumentSource

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 31-bit seed from integers (splitmix64 rounds): stable across runs, hosts and platforms."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & 0x7FFFFFFF


def _round_hash(value: int, key: int) -> int:
    h = (value * 0x9E3779B97F4A7C15 + key) & _MASK64
    h = ((h ^ (h >> 32)) * 0xD6E8FEB86659FD93) & _MASK64
    return h ^ (h >> 32)


def permute_index(index: int, size: int, seed: int, rounds: int = 4) -> int:
    """Where `index` goes in a seeded pseudo-random permutation of range(size): O(1), no table.

    A balanced Feistel network over the smallest even bit width covering `size`, with cycle
    walking (re-applied until the result is below `size`, at most ~4 times on average), so
    it is a bijection of range(size) for any size >= 1.
    """
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [mix_seed(seed, r) for r in range(rounds)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_round_hash(right, key) & mask)
        x = (left << half) | right
        if x < size:
            return x


class LaneStream:
    """The chunk stream of lane `lane` of `num_lanes` (see the module docstring).

    Args:
      sources: the sources this phase draws from (weight > 0), as train splits.
      weights: mixture weights, one per source (any positive scale).
      seeds: one shuffle seed per source.
      lane, num_lanes: this lane's row index r and the global batch size B.
      seq_len: L; chunks have at most L+1 tokens.
      row_format: how documents are cut into pieces (packing.CHUNKS: text and chat documents).
    """

    def __init__(self, sources: Sequence[DocumentSource], weights: Sequence[float], seeds: Sequence[int],
                 lane: int, num_lanes: int, seq_len: int, row_format: packing.RowFormat = packing.CHUNKS):
        total = float(sum(weights))
        self._sources, self._seeds, self._format = list(sources), list(seeds), row_format
        self._shares = [w / total for w in weights]
        self._lane, self._num_lanes, self._seq_len = lane, num_lanes, seq_len
        self._drawn = [0] * len(sources)   # documents drawn from each source by this lane
        self._tokens = [0] * len(sources)  # the row positions their pieces take
        self._pending: tuple[int, int, int] | None = None  # (source, draw, next chunk start)
        self._cached: tuple[tuple[int, int], np.ndarray] | None = None

    def _document(self, source: int, draw: int) -> np.ndarray:
        """The document this lane gets on its `draw`-th draw from `source` (int32 [n] or [2, n])."""
        if self._cached is None or self._cached[0] != (source, draw):
            n = len(self._sources[source])
            epoch, i = divmod(self._lane + draw * self._num_lanes, n)
            index = permute_index(i, n, mix_seed(self._seeds[source], epoch))
            document = self._format.training_document(self._sources[source][index],
                                                      mix_seed(self._seeds[source], epoch, index))
            self._cached = ((source, draw), document)
        return self._cached[1]

    def next_chunk(self) -> Any:
        while self._pending is None:
            total = sum(self._tokens)
            s = max(range(len(self._shares)), key=lambda k: self._shares[k] * total - self._tokens[k])
            draw = self._drawn[s]
            self._drawn[s] += 1
            positions = self._format.document_positions(self._document(s, draw), self._seq_len)
            if positions:
                self._tokens[s] += positions
                self._pending = (s, draw, 0)
        s, draw, start = self._pending
        chunk, next_start = self._format.next_piece(self._document(s, draw), start, self._seq_len)
        self._pending = None if next_start is None else (s, draw, next_start)
        return chunk

    def get_state(self) -> dict[str, Any]:
        return {"drawn": list(self._drawn), "tokens": list(self._tokens),
                "pending": None if self._pending is None else list(self._pending)}

    def set_state(self, state: dict[str, Any]) -> None:
        if len(state["drawn"]) != len(self._sources):
            raise ValueError(f"lane state has {len(state['drawn'])} sources, this phase has {len(self._sources)}")
        self._drawn, self._tokens = list(state["drawn"]), list(state["tokens"])
        self._pending = None if state["pending"] is None else tuple(state["pending"])


class SequentialStream:
    """Every piece of one source's documents, in order, once (the evaluation stream)."""

    def __init__(self, source: DocumentSource, seq_len: int, row_format: packing.RowFormat = packing.CHUNKS):
        self._source, self._seq_len, self._format = source, seq_len, row_format
        self._doc, self._start = 0, 0

    def next_chunk(self) -> Any:
        while self._doc < len(self._source):
            doc = self._source[self._doc]
            if self._format.document_positions(doc, self._seq_len):
                chunk, next_start = self._format.next_piece(doc, self._start, self._seq_len)
                if next_start is not None:
                    self._start = next_start
                    return chunk
                self._doc, self._start = self._doc + 1, 0
                return chunk
            self._doc += 1
        return None

    def get_state(self) -> tuple[int, int]:
        return self._doc, self._start

    def set_state(self, state: tuple[int, int]) -> None:
        self._doc, self._start = state
