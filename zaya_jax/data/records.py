"""The record of one document in a prepared shard, per dataset kind (manifest "kind").

    text        ids: `ids.astype(dtype).tobytes()`
    chat        (ids [n], mask [n]): the n ids (dtype), then the n mask bytes (uint8, 1 = supervised)
    preference  (prompt, chosen, rejected): uint32 [3] lengths, then the three id arrays (dtype)
    image_chat  (ids [n], mask [n], images): uint32 [2 + 2k] (n, k images, each image's height and
                width), the n ids (dtype), the n mask bytes, then each image's RGB pixels (uint8
                [height, width, 3], already at the vision processor's size)

`decode` returns what `DocumentSource[i]` gives: int32 [n] (text); int32 [2, n] (chat: row 0
ids, row 1 mask); int32 [2, n] (preference: row 0 prompt ++ chosen ++ rejected, row 1 the part
of each token: 0 prompt, 1 chosen, 2 rejected); ImageChatDocument (image_chat: int32 [2, n] as
chat's, and the images).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

KINDS = ("text", "chat", "preference", "image_chat")


class ImageChatDocument(NamedTuple):
    """A conversation with images: its ids with their expanded image spans, the supervision mask,
    and the images in the order of their spans."""
    tokens: np.ndarray                 # int32 [2, n]: ids, mask (1 = supervised)
    images: tuple[np.ndarray, ...]     # uint8 [h, w, 3] each


def encode(kind: str, document, dtype: np.dtype) -> bytes:
    """One document of `kind` (text ids; chat (ids, mask); preference (prompt, chosen, rejected);
    image_chat (ids, mask, images))."""
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
    if kind == "image_chat":
        ids, mask, images = document
        if len(ids) != len(mask):
            raise ValueError(f"image_chat document: {len(ids)} ids but {len(mask)} mask values")
        images = [np.ascontiguousarray(image, np.uint8) for image in images]
        if any(image.ndim != 3 or image.shape[2] != 3 for image in images):
            raise ValueError("image_chat document: images must be uint8 [height, width, 3]")
        head = np.asarray([len(ids), len(images), *(n for image in images for n in image.shape[:2])], np.uint32)
        return (head.tobytes() + np.asarray(ids, dtype=dtype).tobytes() + np.asarray(mask, np.uint8).tobytes()
                + b"".join(image.tobytes() for image in images))
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def decode(kind: str, data: bytes, dtype: np.dtype) -> np.ndarray | ImageChatDocument:
    """The bytes of one record -> int32 [n] (text), int32 [2, n] (chat, preference), or an
    ImageChatDocument (image_chat)."""
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
    if kind == "image_chat":
        n, k = (int(x) for x in np.frombuffer(data, dtype=np.uint32, count=2))
        sizes = np.frombuffer(data, dtype=np.uint32, count=2 * k, offset=8).reshape(k, 2)
        offset = 8 + 8 * k
        ids = np.frombuffer(data, dtype=dtype, count=n, offset=offset)
        offset += n * dtype.itemsize
        mask = np.frombuffer(data, dtype=np.uint8, count=n, offset=offset)
        offset += n
        images = []
        for h, w in sizes:
            images.append(np.frombuffer(data, dtype=np.uint8, count=int(h * w * 3), offset=offset).reshape(h, w, 3))
            offset += int(h * w * 3)
        return ImageChatDocument(np.stack([ids.astype(np.int32), mask.astype(np.int32)]), tuple(images))
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def statistics(kind: str, document) -> dict[str, int]:
    """What a shard's statistics count for one document: tokens (all ids), and supervised tokens
    (chat, image_chat), images (image_chat) or pairs (preference)."""
    if kind == "text":
        return {"tokens": len(document)}
    if kind in ("chat", "image_chat"):
        counts = {"tokens": len(document[0]), "supervised_tokens": int(np.count_nonzero(document[1]))}
        return counts | ({"images": len(document[2])} if kind == "image_chat" else {})
    return {"tokens": sum(len(part) for part in document), "pairs": 1}
