"""Exact-match accuracy on the generated instruction tasks (zaya_jax.data.instruction_tasks), by
greedy generation: what `python -m zaya_jax.evaluate_tasks` prints for a text run.

  completions = answer_tasks(model, tokenizer, template, tasks, max_new_tokens, batch_size)
  score(tasks, completions) -> {"accuracy", "accuracy_by_kind", "questions", "correct", "examples"}

Each task's question is rendered as a user turn with the chat template and its generation prompt
(chat_template.encode_prompt), completed greedily until eos, the template's end of turn or the
token cap (answering.generate_completions), and the completion's first line is compared exactly
with the task's answer (instruction_tasks.is_correct).
"""

from __future__ import annotations

import collections

from zaya_jax.data import chat_template, instruction_tasks
from zaya_jax.evaluation.answering import generate_completions

EXAMPLES_PER_KIND = 2


def answer_tasks(model, tokenizer, template, tasks: list[instruction_tasks.Task], max_new_tokens: int,
                 batch_size: int) -> list[str]:
    """The model's greedy completion of each task's question, rendered as a user turn with the
    template's generation prompt, up to eos or the template's end of turn."""
    prompts = [chat_template.encode_prompt(template, tokenizer, task.prompt_messages()) for task in tasks]
    return generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size,
                                tuple(chat_template.end_of_turn_ids(template, tokenizer)))


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
