"""Exact prefix caching for CCA: a prompt's state at block boundaries, reused by later prompts.

Shapes: Lf full / Ls sliding / L layers, C tokens per block (the engine's prefill chunk), W ring
slots, K KV heads, H head dim, P = N + K packed q|k heads.

An entry is what one block of a prompt adds to a slot's DecodeState, taken right after the
prefill chunk that ends the block (the engine prefills in blocks from position 0, or from a
restored block boundary, so every chunk ends on a boundary until the prompt's last one):

  keys, values                [Lf,C,K,H] the full layers' keys and values of the block's positions
  window_keys, window_values  [Ls,W,K,H] the sliding layers' whole ring at the block's end
  carry                       CCACarry [L,...]: the CCA carry of the block's last token (pre-conv
                              column [L,P,H], depthwise output [L,P,H], delayed value [L,K/2,H])

Restoring blocks 1..n of a prompt (one compiled call, `restore`, for any n up to a bucket of
`restore_buckets`) writes each block's keys and values into its slots and the last block's ring
and carry: the slot then holds exactly the state the chunked prefill of those
n x C tokens left, so a hit computes what a miss computes. Entries are keyed by a hash chained
over the blocks (block i's key hashes block i-1's key and block i's tokens) and hold their
tokens, compared on lookup. A prompt reuses at most its first len - 1 tokens: its last token's
logits are needed. LRU eviction under a byte budget; a block is always used more recently than
the blocks after it, so the LRU entry is never one whose descendants stay behind.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from typing import NamedTuple

import jax
import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.engine.buckets import doubling_buckets
from zaya_jax.infer.cache import DecodeState, state_shapes
from zaya_jax.model.cca import CCACarry


class Entry(NamedTuple):
    keys: jax.Array           # [Lf,C,K,H]
    values: jax.Array         # [Lf,C,K,H]
    window_keys: jax.Array    # [Ls,W,K,H]
    window_values: jax.Array  # [Ls,W,K,H]
    carry: CCACarry           # [L,P,H], [L,P,H], [L,K/2,H]


def snapshot_fn(state: DecodeState, slot: jax.Array, start: jax.Array, *, block: int) -> Entry:
    """slot's block of positions [start, start + C = `block`) with its ring and carry as they are now."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x[:, slot], start, block, axis=1)  # noqa: E731
    return Entry(take(state.keys), take(state.values), state.window_keys[:, slot], state.window_values[:, slot],
                 jax.tree.map(lambda x: x[:, slot], state.carry))


def restore_fn(state: DecodeState, slot: jax.Array, starts: jax.Array, entries: tuple[Entry, ...]) -> DecodeState:
    """The state (donated) with a hit's b entries put into `slot` in one call: entry i's keys and
    values at [starts[i], starts[i] + C), the last entry's ring and carry (lengths is the engine's
    to set). starts: [b] int32. `bucketed` pads a hit to b by repeating its last entry and start
    (writing a block twice writes it once), so each b is one compilation."""
    def put(x, blocks):
        row = x[:, slot]
        for i, block in enumerate(blocks):
            row = jax.lax.dynamic_update_slice_in_dim(row, block, starts[i], axis=1)
        return x.at[:, slot].set(row)
    last = entries[-1]
    return state._replace(keys=put(state.keys, [e.keys for e in entries]),
                          values=put(state.values, [e.values for e in entries]),
                          window_keys=state.window_keys.at[:, slot].set(last.window_keys),
                          window_values=state.window_values.at[:, slot].set(last.window_values),
                          carry=jax.tree.map(lambda x, e: x.at[:, slot].set(e), state.carry, last.carry))


def restore_buckets(cache_size: int, block: int) -> tuple[int, ...]:
    """The entry counts restore compiles for: powers of two below the most blocks a hit can hold
    ((cache_size - 1) // C: a prompt fits cache_size and reuses at most its first len - 1 tokens),
    and that most; () when no block fits."""
    return doubling_buckets(1, (cache_size - 1) // block)


def bucketed(found: list[Entry], block: int, buckets: tuple[int, ...]) -> tuple[np.ndarray, tuple[Entry, ...]]:
    """A hit's entries (block i at position i x C) -> restore's starts [b] and entries, padded to
    the smallest bucket b that holds them by repeating the last."""
    b = next(b for b in buckets if b >= len(found))
    pad = b - len(found)
    return (np.array([i * block for i in range(len(found))] + [(len(found) - 1) * block] * pad, np.int32),
            tuple(found) + (found[-1],) * pad)


SNAPSHOT_JIT = dict(static_argnames=("block",))
RESTORE_JIT = dict(donate_argnums=(0,))
snapshot = jax.jit(snapshot_fn, **SNAPSHOT_JIT)
restore = jax.jit(restore_fn, **RESTORE_JIT)


def entry_bytes(cfg: ModelConfig, block: int, cache_size: int) -> int:
    """Bytes one entry of C = `block` tokens holds, read off the abstract shapes (no allocation)."""
    state = state_shapes(cfg, 1, cache_size)
    entry = jax.eval_shape(functools.partial(snapshot, block=block), state, np.int32(0), np.int32(0))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(entry))


def block_keys(tokens: np.ndarray, block: int) -> list[bytes]:
    """tokens: [S] -> the chained key of each full block of C = `block` tokens (S // C keys)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block + 1, block):
        parent = hashlib.blake2b(parent + np.asarray(tokens[start:start + block], np.int64).tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Entries by chained block key, least recently used first, within `budget` bytes."""

    def __init__(self, block: int, budget: int):
        self.block, self.budget = block, budget
        self._entries: collections.OrderedDict[bytes, tuple[np.ndarray, Entry, int]] = collections.OrderedDict()
        self.bytes = self.hits = self.misses = self.tokens_reused = self.evictions = 0

    def stats(self) -> dict:
        return dict(prefix_hits=self.hits, prefix_misses=self.misses, prefix_tokens_reused=self.tokens_reused,
                    prefix_entries=len(self._entries), prefix_bytes=self.bytes,
                    prefix_evictions=self.evictions)

    def lookup(self, prompt: np.ndarray, chain: list[bytes]) -> list[Entry]:
        """prompt: [S]; chain: its block_keys -> the entries of the longest cached prefix of
        prompt[:-1], in order (a hit if any)."""
        found = []
        for i, key in enumerate(chain[:(len(prompt) - 1) // self.block]):
            held = self._entries.get(key)
            if held is None or not np.array_equal(held[0], prompt[i * self.block:(i + 1) * self.block]):
                break
            found.append(held[1])
        self._touch(chain[:len(found)])
        self.hits, self.misses = self.hits + bool(found), self.misses + (not found)
        self.tokens_reused += len(found) * self.block
        return found

    def wants(self, chain: list[bytes], end: int) -> bool:
        """Whether the prompt's block ending at `end` is worth storing: a full block, not held yet,
        whose parent block is held (a lookup never reaches an orphan)."""
        blocks = end // self.block
        return (end % self.block == 0 and blocks > 0 and chain[blocks - 1] not in self._entries
                and (blocks == 1 or chain[blocks - 2] in self._entries))

    def insert(self, prompt: np.ndarray, chain: list[bytes], end: int, entry: Entry) -> None:
        """Store the block of prompt ending at `end` (that `wants`), evicting least recently used
        entries to stay within the budget (an entry larger than the budget is not kept)."""
        size = sum(x.nbytes for x in jax.tree.leaves(entry))
        if size > self.budget:
            return
        while self.bytes + size > self.budget:
            _, (_, _, freed) = self._entries.popitem(last=False)
            self.bytes -= freed
            self.evictions += 1
        self._entries[chain[end // self.block - 1]] = (np.array(prompt[end - self.block:end]), entry, size)
        self.bytes += size
        self._touch(chain[:end // self.block])

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used, deepest block first: each block ends more recent than its descendants."""
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)
