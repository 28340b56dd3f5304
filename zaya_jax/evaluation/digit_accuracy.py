"""Held-out accuracy of a vision-language model on the digits demo, by greedy generation.

  digit_accuracy(model, tokenizer, processor, conversations, template) -> {"accuracy", "correct", "by_digit", ...}
  score_digits(model, tokenizer, processor, template) -> the held-out digits scored as each of
    demo_images.VARIANTS (plain, moved, drawn at another size, fainter), and with black images:
    what benchmarks/demos/vl_demo.py records
  score_vision_run(run, step, model, tokenizer, template) -> score_digits with the images resized as
    the run's config says: what `python -m zaya_jax.evaluate_tasks --checkpoint RUN` prints for a VL run

Each conversation (demo_images.digit_conversations: an image and "Which digit is this?") is
rendered as its user turn with the generation prompt (the chat template the data was prepared
with), its image's span expanded as the processor sizes it, and answered greedily; the answer is
right when its text, stripped, is the digit (up to eos or MAX_NEW_TOKENS, answering's cap).
`blank=True` replaces every image by a black one of its size: the same prompts without what the
image shows (an ablation: near chance if the model reads the image).
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import numpy as np

from zaya_jax.data.chat_template import ChatTemplate, encode_prompt
from zaya_jax.evaluation.answering import BATCH_SIZE, MAX_NEW_TOKENS, generate_completions
from zaya_jax.data.vision.chat import flatten_content
from zaya_jax.data.vision.demo_images import VARIANTS, digit_conversations, digit_variant
from zaya_jax.model.vision.vl import ZayaVL
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.data.vision.prompts import expand_placeholders


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
                   template: ChatTemplate, *, blank: bool = False, max_new_tokens: int = MAX_NEW_TOKENS,
                   batch_size: int = BATCH_SIZE) -> dict:
    """Exact-match accuracy over `conversations`, each one's result in order (`correct`: "1" right,
    "0" wrong), per digit, and the commonest answers."""
    prompts, answers = digit_prompts(template, tokenizer, processor, model, conversations)
    images = [[np.zeros_like(image) if blank else image for image in c["images"]] for c in conversations]
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size, images=images,
                                       image_processor=processor)
    right, total, each = collections.Counter(), collections.Counter(), []
    for answer, completion in zip(answers, completions, strict=True):
        correct = completion.strip() == answer
        each.append("1" if correct else "0")
        right[answer] += correct
        total[answer] += 1
    return {"accuracy": round(sum(right.values()) / len(answers), 4), "questions": len(answers),
            "correct": "".join(each), "by_digit": {d: round(right[d] / total[d], 4) for d in sorted(total)},
            "answers": collections.Counter(c.strip() for c in completions).most_common(12)}


def score_digits(model: ZayaVL, tokenizer, processor: ImageProcessor, template: ChatTemplate, *,
                 max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE) -> dict:
    """The held-out digits scored as each of VARIANTS, and with black images -> {"questions",
    "accuracy" (plain), "accuracy_by_variant", "accuracy_with_black_images", "variants": {variant:
    digit_accuracy's result}, "black_images": digit_accuracy's result}."""
    heldout = digit_conversations("heldout")
    score = functools.partial(digit_accuracy, model, tokenizer, processor, template=template,
                              max_new_tokens=max_new_tokens, batch_size=batch_size)
    variants = {variant: score(digit_variant(heldout, variant)) for variant in VARIANTS}
    black = score(heldout, blank=True)
    return {"questions": len(heldout), "accuracy": variants["plain"]["accuracy"],
            "accuracy_by_variant": {variant: result["accuracy"] for variant, result in variants.items()},
            "accuracy_with_black_images": black["accuracy"], "variants": variants, "black_images": black}


def score_vision_run(checkpoint: str, step: int, model, tokenizer, template: ChatTemplate, *,
                     max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE) -> dict:
    """A vision-language run's ZayaVL scored on the held-out digits (score_digits),
    images resized as the run's config says."""
    from zaya_jax.data.vision.processor import image_processor
    from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config
    processor = image_processor(read_config(checkpoint_dir(checkpoint), step))
    return score_digits(model, tokenizer, processor, template, max_new_tokens=max_new_tokens, batch_size=batch_size)
