"""Exact-match accuracy on the held-out instruction tasks, or a vision-language run's on the
held-out digits, by greedy generation. Prints JSON.

  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_sft [--per_kind 100] [--max_new_tokens 8]
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_vl

The held-out questions of zaya_jax.data.instruction_tasks (`--per_kind` of each kind, none of
which the demo's SFT or DPO data contains) are rendered as a user turn with the chat template
and its generation prompt (chat_template.encode_prompt, the tokens a chat user would send), then
the checkpoint's model generates greedily (zaya_jax.infer.static_loop) until eos or
`--max_new_tokens`. The completion's first line is its answer (instruction_tasks.extract_answer),
compared exactly with the task's answer. The tokenizer is the one the checkpoint carries (the file
its run was trained with; a --tokenizer that is another file is refused), the chat template the one
it recorded (a run on chat or preference data), else plain.jinja (--chat_template overrides);
generation also stops at the template's end of turn (chat_template.end_of_turn_ids). The JSON gives
the accuracy overall and per kind, each question's result in order ("correct": "1" or "0" per
question, to compare two checkpoints on the same questions) and the first completions of each kind.

A vision-language run's checkpoint (configs/demo_vl.py) is scored on the digits demo instead
(zaya_jax.evaluation.digit_accuracy.score_vision_run): the 359 held-out digits as they are, moved by one
pixel, by two along each axis, drawn at another size, at 6 of 8 pixels, and at 60% contrast
(demo_images.VARIANTS), its images resized as the run's
config says; the JSON gives the accuracy per variant ("accuracy" is the plain digits'), and per
variant each digit's result in order, the accuracy per digit and the commonest answers.
`--per_kind` and `--seed` choose text tasks and are not read there.

The command holds its flags; the scoring is zaya_jax.evaluation's (answering, tasks, digit_accuracy).
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import instruction_tasks
from zaya_jax.evaluation import answering
from zaya_jax.evaluation.answering import BATCH_SIZE, define_answering_flags, load_checkpoint, run_template
from zaya_jax.evaluation.digit_accuracy import score_vision_run
from zaya_jax.evaluation.tasks import answer_tasks, score
from zaya_jax.model.vision.vl import is_vision_language


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI."""
    define_answering_flags(per_kind=100, per_kind_help="Held-out questions of each kind (text runs).",
                           batch_size=BATCH_SIZE)
    flags.adopt_module_key_flags(answering)  # --help lists them as this command's own


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
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
