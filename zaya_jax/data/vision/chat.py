"""Conversations with images, as TRL's vision-language SFT takes them, into training documents.

  {"images": [img, ...],
   "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "7"}]}]}

A message's content is a string or a list of parts ({"type": "text", "text": ...} or {"type":
"image"}); the k-th image part is images[k]. The chat template renders the conversation with each
image part as one placeholder, which becomes the image's span (vision_start, one image token per
merged patch, vision_end; never supervised), and the images are resized by the tower's processor
(stored as uint8 pixels: records.ImageChatDocument; patches are cut when rows are made,
vision.image_rows). `image_chat_encoder` is the prepare CLI's (--kind image_chat): records whose
`images` are file paths, sized by a config file's vision section (--vision_config).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from zaya_jax.config_files import load_config_file, vision_config
from zaya_jax.data.chat_template import IMAGE, ChatTemplate, ConversationError, encode_conversation
from zaya_jax.data.records import ImageChatDocument
from zaya_jax.data.vision.processor import ImageProcessor, image_processor, read_image
from zaya_jax.data.vision.prompts import expand_placeholders
from zaya_jax.errors import UserError
from zaya_jax.model.vision.vl import ImageTokenIds


def flatten_content(messages: Sequence[dict]) -> tuple[list[dict], int]:
    """Messages with list contents -> the same with string contents (IMAGE for each image part)
    and the number of image parts."""
    flat, images = [], 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    parts.append(IMAGE)
                    images += 1
                elif kind == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise ConversationError(f"messages[{i}]: a content part must be {{'type': 'text', 'text': ...}} "
                                            f"or {{'type': 'image'}}, got {part!r}")
            message = {**message, "content": "".join(parts)}
        flat.append(message)
    return flat, images


def encode_image_chat(template: ChatTemplate, tokenizer, messages: Sequence[dict], images: Sequence,
                      processor: ImageProcessor, token_ids: ImageTokenIds) -> ImageChatDocument:
    """One conversation and its images (uint8 arrays or Pillow images, in the order of their parts)
    -> its document: ids with each image's span, mask 1 on assistant text, the resized images."""
    flat, parts = flatten_content(messages)
    if parts != len(images):
        raise ConversationError(f"the conversation has {parts} image parts for {len(images)} images")
    ids, mask = encode_conversation(template, tokenizer, flat, image_id=token_ids.image)
    resized = [processor.resize(image) for image in images]
    p = processor.patch_size
    grids = [(1, r.shape[0] // p, r.shape[1] // p) for r in resized]
    ids, mask = expand_placeholders(ids, grids, token_ids, processor.merge_size, mask=mask)
    return ImageChatDocument(np.stack([np.asarray(ids, np.int32), np.asarray(mask, np.int32)]), tuple(resized))


def vision_section_of(config_path: str | None) -> dict:
    """The vision section of the config file `config_path` as plain values (what a prepared image_chat
    source is sized by); UserError naming the flag when there is no file or no section."""
    if config_path is None:
        raise UserError("--kind image_chat needs --vision_config FILE: a config file with a vision section (the run's, "
                        "e.g. configs/demo_vl.py), whose tower, image token ids and min/max pixels size the images")
    try:
        config = load_config_file(config_path)
    except FileNotFoundError as err:
        raise UserError(f"--vision_config: {err}") from err
    if "vision" not in config:
        raise UserError(f"--vision_config {config_path}: the config has no vision section (a ZAYA1-VL model's; "
                        "config_files.vision_section)")
    return config.vision.to_dict()


def image_chat_encoder(template: ChatTemplate, tokenizer, config_path: str, base_dir: str,
                       messages_field: str) -> Callable[[dict], tuple]:
    """A record {messages_field: messages, "images": [file paths relative to base_dir]} -> the
    image_chat record (ids, mask, resized images); an image file it cannot read is a ConversationError
    naming it."""
    config = load_config_file(config_path)
    processor, (_, token_ids) = image_processor(config), vision_config(config)

    def encode(values: dict) -> tuple:
        images = []
        for k, name in enumerate(values["images"]):
            try:
                images.append(read_image(os.path.join(base_dir, name) if isinstance(name, str) else None))
                processor.size(images[-1].height, images[-1].width)   # one below the processor's minimum is named
            except (ValueError, UserError) as err:
                raise ConversationError(f"images[{k}] {name!r}: {err}") from err
        doc = encode_image_chat(template, tokenizer, values[messages_field], images, processor, token_ids)
        return (*doc.tokens, doc.images)
    return encode
