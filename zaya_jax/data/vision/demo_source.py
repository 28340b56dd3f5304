"""`demo:digits`, the vision-language demo's source: scikit-learn's digits as image_chat
documents, built offline on first use next to the demo corpus whose tokenizer it uses.

Each conversation (demo_images.digit_conversations: the image, "Which digit is this?", the digit)
is rendered with the plain chat template and the demo tokenizer, its 8x8 image resized to
DIGIT_PIXELS (16x16, so 16 patches of 4x4 pixels and 4 image tokens for a tower of patch_size 4 and
spatial_merge_size 2: configs/demo_vl.py's), and its image span written with DEMO_IMAGE_IDS. The
source holds the 1,438 training digits, then the 359 held-out ones: a data config with
`heldout_fraction = HELDOUT_FRACTION` evaluates on exactly the held-out digits.

DEMO_IMAGE_IDS are the demo tokenizer's three last (rarest) BPE merges: the text model keeps its
vocabulary, and building fails if a conversation's text encodes to one of them.
"""

from __future__ import annotations

import os
import pathlib

from zaya_jax.data import chat_template, demo_corpus, prepare, records, tokenizer
from zaya_jax.data.vision.chat import encode_image_chat
from zaya_jax.data.vision.demo_images import HELDOUT_SHARE, digit_conversations
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.model.vision.vl import ImageTokenIds

BUILD_VERSION = 2
DEMO_IMAGE_IDS = ImageTokenIds(image=4093, vision_start=4094, vision_end=4095)
DIGIT_PIXELS = 16 * 16
PATCH_SIZE, MERGE_SIZE = 4, 2   # the tower the source's image spans are written for
HELDOUT_FRACTION = HELDOUT_SHARE


def digit_documents(tok: tokenizer.Tokenizer, template: chat_template.ChatTemplate) -> list[records.ImageChatDocument]:
    """The training digits, then the held-out ones, as image_chat documents rendered with `template`."""
    processor = ImageProcessor(PATCH_SIZE, MERGE_SIZE, 1, min_pixels=DIGIT_PIXELS, max_pixels=DIGIT_PIXELS)
    return [encode_image_chat(template, tok, c["messages"], c["images"], processor, DEMO_IMAGE_IDS)
            for split in ("train", "heldout") for c in digit_conversations(split)]


def build_digit_source(cache_dir: str | os.PathLike | None = None, *, max_docs: int = 0, vocab_size: int = 4096,
                       seed: int = 0, progress: bool = True) -> pathlib.Path:
    """Builds `demo:digits` unless cached -> its prepared dir (the settings are the demo corpus's, data.demo)."""
    corpus = demo_corpus.build_demo_corpus(cache_dir, max_docs=max_docs, vocab_size=vocab_size, seed=seed,
                                           progress=progress)
    tok = tokenizer.Tokenizer(corpus.tokenizer, bos_id=2, eos_id=1, pad_id=0)
    if max(DEMO_IMAGE_IDS) >= tok.vocab_size:
        raise ValueError(f"demo:digits needs a tokenizer of at least {max(DEMO_IMAGE_IDS) + 1} ids, the demo "
                         f"corpus's has {tok.vocab_size} (data.demo.vocab_size)")
    key = f"{corpus.root.name}-digits-v{BUILD_VERSION}-px{DIGIT_PIXELS}-p{PATCH_SIZE}m{MERGE_SIZE}"

    def build(work: pathlib.Path) -> dict:
        template = chat_template.ChatTemplate.load(chat_template.PLAIN)
        documents = [(*doc.tokens, doc.images) for doc in digit_documents(tok, template)]  # (ids, mask, images)
        manifest = prepare.write_tokenized(str(work / "digits"), documents, tokenizer_info=tok.info(),
                                           kind="image_chat", chat_template=template)
        return {"digits": {"documents": manifest["num_documents"], "tokens": manifest["num_tokens"]}}

    return demo_corpus.build_once(corpus.root.parent, key, build) / "digits"
