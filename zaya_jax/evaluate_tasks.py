"""Exact-match accuracy on the held-out instruction tasks, or a vision-language run's on the
held-out digits, by greedy generation. Prints JSON.

  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_sft [--per_kind 100] [--max_new_tokens 8]
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_vl

The held-out questions of zaya_jax.data.instruction_tasks (`--per_kind` of each kind, none of
which the demo's SFT or DPO data contains) are rendered as a user turn with the chat template
and its generation prompt (chat_template.encode_prompt, the tokens a chat user would send), then
the checkpoint's model generates greedily (zaya_jax.infer.generate) until eos or
`--max_new_tokens`. The completion's first line is its answer (instruction_tasks.extract_answer),
compared exactly with the task's answer. The tokenizer is the one the checkpoint carries (the file
its run was trained with; a --tokenizer that is another file is refused), the chat template the one
it recorded (a run on chat or preference data), else plain.jinja (--chat_template overrides);
generation also stops at the template's end of turn (chat_template.end_of_turn_ids). The JSON gives
the accuracy overall and per kind, each question's result in order ("correct": "1" or "0" per
question, to compare two checkpoints on the same questions) and the first completions of each kind.

A vision-language run's checkpoint (configs/demo_vl.py) is scored on the digits demo instead
(zaya_jax.vision.digit_accuracy.score_digits): the 359 held-out digits as they are, moved by one
pixel, by two along each axis, drawn at another size, at 6 of 8 pixels, and at 60% contrast
(demo_images.VARIANTS), its images resized as the run's
config says; the JSON gives the accuracy per variant ("accuracy" is the plain digits'), and per
variant each digit's result in order, the accuracy per digit and the commonest answers.
`--per_kind` and `--seed` choose text tasks and are not read there.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import numpy as np
from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import chat_template, instruction_tasks
from zaya_jax.errors import UserError

EXAMPLES_PER_KIND = 2
MAX_NEW_TOKENS = 8
BATCH_SIZE = 100


def define_answering_flags(*, per_kind: int, per_kind_help: str, batch_size: int) -> None:
    """The flags of a command that answers generated tasks with a checkpoint's model (this one and
    zaya_jax.preference_pairs), with their defaults of per_kind and batch_size."""
    flags.DEFINE_string("checkpoint", None, "Training run WORKDIR or its checkpoints/ directory.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest whole one).")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the one the checkpoint carries; for a "
                                           "checkpoint that carries none, its run's data.tokenizer).")
    flags.DEFINE_string("chat_template", None,
                        "Chat template: a .jinja file or a tokenizer_config.json with chat_template (default: the "
                        "one the run recorded, else zaya_jax/data/chat_templates/plain.jinja).")
    flags.DEFINE_integer("per_kind", per_kind, per_kind_help, lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Task generation seed (the demo data's is 0).")
    flags.DEFINE_integer("max_new_tokens", MAX_NEW_TOKENS, "Token cap of a completion.", lower_bound=1)
    flags.DEFINE_integer("batch_size", batch_size, "Questions generated together.", lower_bound=1)


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI (its functions are a library)."""
    define_answering_flags(per_kind=100, per_kind_help="Held-out questions of each kind (text runs).",
                           batch_size=BATCH_SIZE)


def generate_completions(model, tokenizer, prompts: list[np.ndarray], max_new_tokens: int,
                         batch_size: int, stop_ids: tuple[int, ...] = (), images: list | None = None,
                         image_processor=None) -> list[str]:
    """Greedy completions of `prompts` (int32 [n_i] each), decoded up to the first eos or stop id;
    for a ZayaVL, `images` holds each prompt's images (zaya_jax.infer.generate's images, resized
    and cut by `image_processor`).

    Batches are filled up to `batch_size` with the last prompt, so every batch of one prompt
    width reuses one compiled program."""
    from zaya_jax.infer.generate import generate, stop_tokens
    from zaya_jax.model.vision.vl import text_model
    stops = stop_tokens(text_model(model).config.eos_token_id, stop_ids)
    texts = []
    def filled(rows: list) -> list:  # a short last batch repeats its last row
        return rows + [rows[-1]] * (batch_size - len(rows))
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        extra = {}
        if images is not None:
            extra = dict(images=filled(images[start:start + batch_size]), image_processor=image_processor)
        new = generate(model, [list(p) for p in filled(batch)], max_new_tokens, stop_ids=stop_ids, **extra)
        for row in new[:len(batch)]:
            ids = row.tolist()
            end = next((i for i, token in enumerate(ids) if token in stops), len(ids))
            texts.append(tokenizer.decode(ids[:end]))
    return texts


def score(tasks: list[instruction_tasks.Task], completions: list[str]) -> dict:
    """Accuracy overall and per kind, each question's result in task order (`correct`: "1" right,
    "0" wrong, for paired comparisons of two checkpoints), and the first EXAMPLES_PER_KIND
    completions of each kind."""
    right, total, examples = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    each = []
    for task, completion in zip(tasks, completions, strict=True):
        correct = instruction_tasks.is_correct(task, completion)
        each.append("1" if correct else "0")
        right[task.kind] += correct
        total[task.kind] += 1
        if len(examples[task.kind]) < EXAMPLES_PER_KIND:
            examples[task.kind].append({"question": task.question, "answer": task.answer,
                                        "completion": completion, "correct": correct})
    return {"accuracy": round(sum(right.values()) / sum(total.values()), 4),
            "accuracy_by_kind": {k: round(right[k] / total[k], 4) for k in total},
            "questions": sum(total.values()), "correct": "".join(each), "examples": dict(examples)}


def load_checkpoint(checkpoint: str, step: int | None, tokenizer_path: str | None = None, *,
                    vision: bool = False):
    """(model, step, tokenizer) of a training run's checkpoint; the tokenizer is the one the step
    carries (the file its run was trained with; a `tokenizer_path` that is another file is refused).
    A vision-language run's ZayaVL only with `vision` (what this command scores on the digits); else
    refused naming that command."""
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.checkpoints.carried_tokenizer import checkpoint_tokenizer
    from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model

    from zaya_jax.model.vision.vl import is_vision_language, text_model
    model, step = load_checkpoint_model(checkpoint, step)
    if is_vision_language(model) and not vision:
        raise UserError(f"--checkpoint {checkpoint} holds a vision-language model: this command answers text "
                        f"questions with a text model (python -m zaya_jax.evaluate_tasks --checkpoint {checkpoint} "
                        "scores it on the held-out digits)")
    cfg = text_model(model).config
    path, told = checkpoint_tokenizer(checkpoint, step, tokenizer_path)
    print(told, file=sys.stderr)
    tokenizer = Tokenizer(path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    return model, step, tokenizer


def run_template(checkpoint: str, path: str | None) -> chat_template.ChatTemplate:
    """`path` (--chat_template), else the template the run recorded, else plain.jinja."""
    from zaya_jax.infer.chat import checkpoint_chat_template
    if path is not None:
        return chat_template.ChatTemplate.load(path)
    return checkpoint_chat_template(checkpoint) or chat_template.ChatTemplate.load(chat_template.PLAIN)


def answer_tasks(model, tokenizer, template, tasks: list[instruction_tasks.Task], max_new_tokens: int,
                 batch_size: int) -> list[str]:
    """The model's greedy completion of each task's question, rendered as a user turn with the
    template's generation prompt, up to eos or the template's end of turn."""
    prompts = [chat_template.encode_prompt(template, tokenizer, task.prompt_messages()) for task in tasks]
    return generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size,
                                tuple(chat_template.end_of_turn_ids(template, tokenizer)))


def score_vision_run(checkpoint: str, step: int, model, tokenizer, template: chat_template.ChatTemplate, *,
                     max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE) -> dict:
    """A vision-language run's ZayaVL scored on the held-out digits (vision.digit_accuracy.score_digits),
    images resized as the run's config says."""
    from zaya_jax.data.vision.processor import image_processor
    from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config
    from zaya_jax.vision.digit_accuracy import score_digits
    processor = image_processor(read_config(checkpoint_dir(checkpoint), step))
    return score_digits(model, tokenizer, processor, template, max_new_tokens=max_new_tokens, batch_size=batch_size)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from zaya_jax.model.vision.vl import is_vision_language
    f = flags.FLAGS
    start = time.perf_counter()
    template = run_template(f.checkpoint, f.chat_template)
    model, step, tokenizer = load_checkpoint(f.checkpoint, f.step, f.tokenizer, vision=True)
    if is_vision_language(model):
        result = score_vision_run(f.checkpoint, step, model, tokenizer, template, max_new_tokens=f.max_new_tokens,
                                  batch_size=f.batch_size)
        asked = f"{result['questions']} digits x {len(result['variants'])} variants"
    else:
        tasks = instruction_tasks.tasks("heldout", f.per_kind, f.seed)
        completions = answer_tasks(model, tokenizer, template, tasks, f.max_new_tokens, f.batch_size)
        result = score(tasks, completions)
        asked = f"{len(tasks)} questions"
    print(f"[{asked} in {time.perf_counter() - start:.1f}s including loading and compilation]", file=sys.stderr)
    print(json.dumps({"checkpoint": f.checkpoint, "step": step, "chat_template": template.path,
                      "max_new_tokens": f.max_new_tokens, **result}, indent=2))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
