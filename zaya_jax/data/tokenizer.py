"""Tokenizers from local files: a HF `tokenizer.json` or a SentencePiece `.model`.

Nothing here touches the network. The special ids are not read from the tokenizer file: they
come from the model config (ZAYA1 / Gemma-3: bos=2, eos=1, pad=0) and are passed in, so a
prepared dataset and the model always agree on them.

    tok = Tokenizer("/models/gemma3/tokenizer.json", bos_id=2, eos_id=1, pad_id=0)
    tok.encode_document("Hello")   # int32 [n + 2]: bos, the text's ids, eos

`train_bpe` trains a small byte-level BPE (the demo corpus's tokenizer) whose first three
ids are <pad>=0, <eos>=1, <bos>=2, matching the ZAYA1 config.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from zaya_jax.errors import MissingInputError

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2 of a tokenizer made by train_bpe


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (how prepared shards store tokens)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Tokenizer:
    """Text <-> token ids from a local tokenizer file.

    Args:
      path: a HF `tokenizers` JSON file (`*.json`) or a SentencePiece model (anything else).
      bos_id, eos_id, pad_id: special ids from the model config; each must be < vocab_size.
    """

    def __init__(self, path: str | os.PathLike, *, bos_id: int, eos_id: int, pad_id: int):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise MissingInputError(f"tokenizer file {self.path!r} does not exist")
        self.kind = "hf" if self.path.endswith(".json") else "sentencepiece"
        if self.kind == "hf":
            import tokenizers  # pylint: disable=g-import-not-at-top
            self._hf = tokenizers.Tokenizer.from_file(self.path)
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        else:
            try:
                import sentencepiece  # pylint: disable=g-import-not-at-top
            except ImportError as e:
                raise ImportError(f"{self.path!r} is not a .json tokenizer, so it needs sentencepiece: "
                                  "pip install sentencepiece") from e
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
            self._sp_cont = None
            self._sp_special = None
            self.vocab_size = self._sp.get_piece_size()
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size}) of {self.path}")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.sha256 = file_sha256(self.path)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (HF encodes in parallel threads)."""
        if self.kind == "hf":
            return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        return self._sp.encode(list(texts))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of consecutive pieces of one text (a chat's prompt and assistant spans), no
        special tokens: the first piece as `encode` gives it, the others as its continuation (a
        SentencePiece model adds its dummy-prefix space only before the first)."""
        if self.kind == "hf" or len(texts) < 2:
            return self.encode_batch(texts) if texts else []
        return [*self.encode_batch(texts[:1]), *self._sp_continuation().encode(list(texts[1:]))]

    def _sp_continuation(self):
        """The SentencePiece model without its dummy prefix (for text that continues a piece)."""
        if self._sp_cont is None:
            import sentencepiece  # pylint: disable=g-import-not-at-top
            proto = self._sp_model_proto()
            proto.normalizer_spec.add_dummy_prefix = False
            self._sp_cont = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
        return self._sp_cont

    def _sp_model_proto(self):
        """The SentencePiece model's ModelProto (a fresh copy)."""
        from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
        return sentencepiece_model_pb2.ModelProto.FromString(self._sp.serialized_model_proto())

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text as one training document: int32 [n + 2] = bos, its ids, eos."""
        return [np.asarray([self.bos_id, *ids, self.eos_id], dtype=np.int32) for ids in self.encode_batch(texts)]

    def encode_document(self, text: str) -> np.ndarray:
        return self.encode_documents([text])[0]

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` (its token string, e.g. "<bos>"), not decoded text."""
        return self._hf.id_to_token(int(token_id)) if self.kind == "hf" else self._sp.id_to_piece(int(token_id))

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token of the file (an HF added special token, a
        SentencePiece control or user-defined symbol), not a piece of text."""
        if self.kind == "hf":
            added = self._hf.get_added_tokens_decoder().get(int(token_id))
            return added is not None and added.special
        if self._sp_special is None:  # the binding has is_control but no is_user_defined: the pieces' types
            proto = self._sp_model_proto()
            kinds = (proto.SentencePiece.CONTROL, proto.SentencePiece.USER_DEFINED)
            self._sp_special = frozenset(i for i, piece in enumerate(proto.pieces) if piece.type in kinds)
        return int(token_id) in self._sp_special

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id} if skip_special else set()
        ids = [int(i) for i in ids if int(i) not in special]
        if self.kind == "hf":
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp.decode(ids)

    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for (its longest vocabulary entry), so a text
        of more than n times this many characters has more than n tokens; None where no such bound
        holds: a tokenizer that can fold a run of characters into one unknown token (WordLevel,
        WordPiece, a BPE fusing unknowns without byte fallback, SentencePiece) or that drops some
        (a normalizer other than a string Replace by as long a string, a pre-tokenizer removing
        what it splits on)."""
        if self.kind != "hf":
            return None
        spec = json.loads(self._hf.to_str())
        model = spec["model"]
        if model["type"] != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")
                                      and not model.get("byte_fallback")):
            return None
        if not (_keeps_characters(spec.get("normalizer"), _KEEPING_NORMALIZERS)
                and _keeps_characters(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS)):
            return None
        return max(len(token) for token in self._hf.get_vocab(with_added_tokens=True))

    def info(self) -> dict:
        """What a manifest records about the tokenizer."""
        return {"path": self.path, "kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id}


_KEEPING_NORMALIZERS = ("Replace", "Prepend")
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts")


def _keeps_characters(step: dict | None, kinds: tuple[str, ...]) -> bool:
    """Whether a tokenizer.json normalizer or pre-tokenizer (None: none) passes on at least as many
    characters as it is given: one of `kinds` (a Sequence of them), a Replace of a string by one as
    long, a split that does not remove its delimiter."""
    if step is None:
        return True
    if step["type"] == "Sequence":
        return all(_keeps_characters(s, kinds) for s in step.get("normalizers", step.get("pretokenizers", [])))
    if step["type"] not in kinds or step.get("behavior") == "Removed":
        return False
    if step["type"] == "Replace":
        pattern = step["pattern"]
        return "String" in pattern and len(step["content"]) >= len(pattern["String"])
    return True


def train_bpe(texts: Iterable[str], output_path: str | os.PathLike, *, vocab_size: int = 4096,
              min_frequency: int = 2, show_progress: bool = False) -> str:
    """Trains a byte-level BPE on `texts` and writes it as one tokenizer.json; returns its path.

    The special tokens come first: <pad>=0, <eos>=1, <bos>=2.
    """
    import tokenizers  # pylint: disable=g-import-not-at-top
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the 256 byte tokens plus specials, got {vocab_size}")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress)
    output_path = os.fspath(output_path)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    bpe.save(output_path)
    return output_path
