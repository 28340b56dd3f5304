"""The record of one document in a prepared shard, per dataset kind (manifest "kind").

    text        ids: `ids.astype(dtype).tobytes()`
    chat        (ids [n], mask [n]): the n ids (dtype), then the n mask bytes (uint8, 1 = supervised)
    preference  (prompt, chosen, rejected): uint32 [3] lengths, then the three id arrays (dtype)

`decode` returns what `DocumentSource[i]` gives: int32 [n] (text); int32 [2, n] (chat: row 0
ids, row 1 mask); int32 [2, n] (preference: row 0 prompt ++ chosen ++ rejected, row 1 the part
of each token: 0 prompt, 1 chosen, 2 rejected).
"""

from __future__ import annotations

import numpy as np

KINDS = ("text", "chat", "preference")


def encode(kind: str, document, dtype: np.dtype) -> bytes:
    """One document of `kind` (text ids; chat (ids, mask); preference (prompt, chosen, rejected))."""
    if kind == "text":
        return np.asarray(document, dtype=dtype).tobytes()
    if kind == "chat":
        ids, mask = document
        if len(ids) != len(mask):
            raise ValueError(f"chat document: {len(ids)} ids but {len(mask)} mask values")
        return np.asarray(ids, dtype=dtype).tobytes() + np.asarray(mask, dtype=np.uint8).tobytes()
    if kind == "preference":
        parts = [np.asarray(part, dtype=dtype) for part in document]
        return np.asarray([len(p) for p in parts], np.uint32).tobytes() + b"".join(p.tobytes() for p in parts)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def decode(kind: str, data: bytes, dtype: np.dtype) -> np.ndarray:
    """The bytes of one record -> int32 [n] (text) or int32 [2, n] (chat, preference)."""
    dtype = np.dtype(dtype)
    if kind == "text":
        return np.frombuffer(data, dtype=dtype).astype(np.int32)
    if kind == "chat":
        n = len(data) // (dtype.itemsize + 1)
        ids = np.frombuffer(data, dtype=dtype, count=n)
        mask = np.frombuffer(data, dtype=np.uint8, offset=n * dtype.itemsize)
        return np.stack([ids.astype(np.int32), mask.astype(np.int32)])
    if kind == "preference":
        lengths = np.frombuffer(data, dtype=np.uint32, count=3)
        ids = np.frombuffer(data, dtype=dtype, offset=12)
        return np.stack([ids.astype(np.int32), np.repeat(np.arange(3, dtype=np.int32), lengths)])
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def statistics(kind: str, document) -> dict[str, int]:
    """What a shard's statistics count for one document: tokens (all ids), and supervised tokens
    (chat) or pairs (preference)."""
    if kind == "text":
        return {"tokens": len(document)}
    if kind == "chat":
        return {"tokens": len(document[0]), "supervised_tokens": int(np.count_nonzero(document[1]))}
    return {"tokens": sum(len(part) for part in document), "pairs": 1}
