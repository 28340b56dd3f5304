"""DPO rows: preference pairs packed whole, each as two adjacent segments.

A preference document is int32 [2, n]: row 0 = prompt ++ chosen ++ rejected token ids, row 1 the
part of each token (0 prompt, 1 chosen, 2 rejected); P, C, R are the parts' lengths. Pair j of
a row (1-based) takes segments 2j-1 = prompt ++ chosen and 2j = prompt ++ rejected, each packed
like a chat chunk (packing.make_row with mask = "is a completion token"): positions restart at 0,
inputs/targets shift within the sequence, and loss_mask is 1 exactly on completion targets.
A pair takes (P + C - 1) + (P + R - 1) = 2P + C + R - 2 positions and is never split across rows.

Fitting a pair into L positions (TRL's `keep_start` truncation): when 2P + C + R - 2 > L, the
completions are cut from their ends, always the longer one first (on a tie the chosen), until the
pair fits exactly. When not even one completion token each fits (2P > L), or the pair has no
prompt token or an empty completion, the pair is dropped. `fit_statistics` counts both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zaya_jax.data import packing

PROMPT, CHOSEN, REJECTED = 0, 1, 2


def part_lengths(doc: np.ndarray) -> tuple[int, int, int]:
    """(P, C, R) of a preference document int32 [2, n]."""
    p, c, r = np.bincount(doc[1], minlength=3)[:3]
    return int(p), int(c), int(r)


def fitted_completion_lengths(prompt, chosen, rejected, seq_len: int):
    """The completion lengths (chosen, rejected) a pair keeps in L = seq_len positions; (0, 0): dropped.

    Works elementwise on ints or integer arrays of pair lengths (P, C, R).
    """
    prompt, chosen, rejected = (np.asarray(x, np.int64) for x in (prompt, chosen, rejected))
    budget = seq_len + 2 - 2 * prompt  # completion tokens that fit: 2P + C + R - 2 <= L
    excess = np.maximum(0, chosen + rejected - budget)
    longer, shorter = np.maximum(chosen, rejected), np.minimum(chosen, rejected)
    cut = np.minimum(excess, longer - shorter)  # the longer one alone, down to the shorter's length
    rest = excess - cut  # then both, alternately, the chosen first
    chosen_longer = chosen >= rejected
    kept_chosen = np.where(chosen_longer, longer - cut, shorter) - (rest + 1) // 2
    kept_rejected = np.where(chosen_longer, shorter, longer - cut) - rest // 2
    keep = (prompt >= 1) & (kept_chosen >= 1) & (kept_rejected >= 1)
    return np.where(keep, kept_chosen, 0), np.where(keep, kept_rejected, 0)


def fit_statistics(lengths: np.ndarray, seq_len: int) -> dict[str, int]:
    """{"pairs", "truncated", "dropped"} for pairs of lengths int [N, 3] (P, C, R) fitted into L."""
    prompt, chosen, rejected = lengths.T
    kept_chosen, kept_rejected = fitted_completion_lengths(prompt, chosen, rejected, seq_len)
    dropped = kept_chosen == 0
    truncated = ~dropped & ((kept_chosen < chosen) | (kept_rejected < rejected))
    return {"pairs": len(lengths), "truncated": int(truncated.sum()), "dropped": int(dropped.sum())}


def source_part_lengths(source) -> np.ndarray:
    """int64 [N, 3]: (P, C, R) of every document of a preference source (reads each once)."""
    return np.array([part_lengths(source[i]) for i in range(len(source))], np.int64).reshape(-1, 3)


def _sequence(prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
    """int32 [2, P + len(completion)]: prompt ++ completion ids, and 1 on the completion tokens."""
    ids = np.concatenate([prompt, completion])
    mask = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(completion), np.int32)])
    return np.stack([ids, mask]).astype(np.int32)


class PairRows:
    """The packing.RowFormat of preference documents: a piece is one fitted pair, the tuple
    (prompt ++ chosen, prompt ++ rejected) of int32 [2, m] sequences (ids, completion mask)."""

    @staticmethod
    def training_document(doc: np.ndarray, seed: int) -> np.ndarray:
        del seed
        return doc

    @staticmethod
    def document_positions(doc: np.ndarray, seq_len: int) -> int:
        p, c, r = part_lengths(doc)
        kept_chosen, kept_rejected = fitted_completion_lengths(p, c, r, seq_len)
        return int(2 * p + kept_chosen + kept_rejected - 2) if kept_chosen else 0

    @staticmethod
    def next_piece(doc: np.ndarray, start: int, seq_len: int) -> tuple[tuple[np.ndarray, np.ndarray], None]:
        del start  # a pair is one piece
        p, c, r = part_lengths(doc)
        kept_chosen, kept_rejected = (int(n) for n in fitted_completion_lengths(p, c, r, seq_len))
        ids = doc[0]
        return (_sequence(ids[:p], ids[p:p + kept_chosen]), _sequence(ids[:p], ids[p + c:p + c + kept_rejected])), None

    @staticmethod
    def piece_positions(pair: tuple[np.ndarray, np.ndarray]) -> int:
        return sum(s.shape[-1] - 1 for s in pair)

    patch_capacity = 0

    @staticmethod
    def piece_patches(pair: tuple[np.ndarray, np.ndarray]) -> int:
        del pair
        return 0

    @staticmethod
    def make_row(pairs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        return packing.make_row([s for pair in pairs for s in pair], seq_len, pad_id)


PAIRS = PairRows()
