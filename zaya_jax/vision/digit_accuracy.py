"""Held-out accuracy of a vision-language model on the digits demo, by greedy generation.

  digit_accuracy(model, tokenizer, processor, conversations) -> {"accuracy", "answers", "by_digit", ...}

Each conversation (demo_images.digit_conversations: an image and "Which digit is this?") is
rendered as its user turn with the generation prompt (the chat template the data was prepared
with), its image's span expanded as the processor sizes it, and answered greedily; the answer is
right when its text, stripped, is the digit. `blank=True` replaces every image by a black one of
its size: the same prompts without what the image shows (an ablation: near chance if the model
reads the image).
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from zaya_jax.data.chat_template import ChatTemplate, encode_prompt
from zaya_jax.evaluate_tasks import generate_completions
from zaya_jax.vision.chat import flatten_content
from zaya_jax.vision.model import ZayaVL
from zaya_jax.vision.processor import ImageProcessor
from zaya_jax.vision.prompts import expand_placeholders

MAX_NEW_TOKENS = 3


def digit_prompts(template: ChatTemplate, tokenizer, processor: ImageProcessor, model: ZayaVL,
                  conversations: Sequence[dict]) -> tuple[list[np.ndarray], list[str]]:
    """(each conversation's prompt ids with its image span, its answer text)."""
    prompts, answers = [], []
    for c in conversations:
        user, _ = flatten_content([m for m in c["messages"] if m["role"] == "user"])
        ids = encode_prompt(template, tokenizer, user, model.ids.image).tolist()
        ids = expand_placeholders(ids, [processor.grid(image) for image in c["images"]], model.ids,
                                  processor.merge_size)
        prompts.append(np.asarray(ids, np.int32))
        answers.append(next(m for m in c["messages"] if m["role"] == "assistant")["content"][0]["text"])
    return prompts, answers


def digit_accuracy(model: ZayaVL, tokenizer, processor: ImageProcessor, conversations: Sequence[dict],
                   template: ChatTemplate, *, blank: bool = False, batch_size: int = 120) -> dict:
    """Exact-match accuracy over `conversations`, per digit, and the first answers given."""
    prompts, answers = digit_prompts(template, tokenizer, processor, model, conversations)
    images = [[np.zeros_like(image) if blank else image for image in c["images"]] for c in conversations]
    completions = generate_completions(model, tokenizer, prompts, MAX_NEW_TOKENS, batch_size, images=images,
                                       image_processor=processor)
    right, total = collections.Counter(), collections.Counter()
    for answer, completion in zip(answers, completions, strict=True):
        right[answer] += completion.strip() == answer
        total[answer] += 1
    return {"accuracy": round(sum(right.values()) / len(answers), 4), "questions": len(answers),
            "by_digit": {d: round(right[d] / total[d], 4) for d in sorted(total)},
            "answers": collections.Counter(c.strip() for c in completions).most_common(12)}
