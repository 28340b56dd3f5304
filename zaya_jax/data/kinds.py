"""The kind of a run's prepared sources (text, chat, preference or image_chat) and the rows each
kind makes.

text -> pretraining rows, chat -> SFT rows (packing.CHUNKS for both), preference -> DPO rows
(preference_rows.PAIRS); image_chat (conversations with images) makes rows only for a ZAYA1-VL
model (vision.image_rows.ImageChatRows, built from its tower: the run's config has a vision
section), so `row_format` takes them from the caller and refuses image_chat data without them. All sources a pipeline or the held-out evaluation opens must be of
one kind, since one run trains one objective on them.
"""

from __future__ import annotations

from collections.abc import Mapping

from zaya_jax.config import ConfigError
from zaya_jax.data import packing, preference_rows
from zaya_jax.data.sources import PreparedSource

ROW_FORMATS: dict[str, packing.RowFormat] = {  # one per records.KINDS but image_chat
    "text": packing.CHUNKS, "chat": packing.CHUNKS, "preference": preference_rows.PAIRS}


def row_format(kind: str, image_rows: packing.RowFormat | None = None) -> packing.RowFormat:
    """The rows a run makes of `kind`: image_chat data takes `image_rows` (a vision model's
    ImageChatRows; ConfigError without them), every other kind its ROW_FORMATS entry."""
    if kind == "image_chat":
        if image_rows is None:
            raise ConfigError("data.sources hold image_chat data (conversations with images), which trains a "
                              "vision-language model: add a vision section to the config (configs/demo_vl.py)")
        return image_rows
    return ROW_FORMATS[kind]


def sources_kind(sources: Mapping[str, PreparedSource]) -> str:
    """The one kind of `sources`; ConfigError naming two sources whose kinds differ."""
    kinds = {name: source.kind for name, source in sources.items()}
    first = next(iter(kinds))
    for name, kind in kinds.items():
        if kind != kinds[first]:
            raise ConfigError(f"data.sources.{first} holds {kinds[first]} data but data.sources.{name} holds "
                              f"{kind} data: the sources of a run must be of one kind (prepare them with the "
                              f"same --kind, or list only one kind in data.sources)")
    return kinds[first]
