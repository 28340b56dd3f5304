"""On-policy DPO pairs from a model's greedy answers to the training questions: what
`python -m zaya_jax.preference_pairs` writes.

  records = onpolicy_records(tasks, completions, near_miss_for_correct=True)
  manifest = write_pairs(output, records, tokenizer_path=..., template_path=..., ids=(bos, eos, pad),
                         made_from={...})   # OUTPUT/pairs.jsonl prepared as a preference dataset

A wrong (non-empty) completion is the rejected answer, the task's answer the chosen one; a right
one gives the task's near miss as the rejected answer (unless not asked for). OUTPUT is built
beside itself and renamed into place (whole or absent); OUTPUT/pairs_made_from.json records
`made_from`.
"""

from __future__ import annotations

import json
import os
import shutil

from zaya_jax.data import chat_template, instruction_tasks, prepare
from zaya_jax.errors import UserError
from zaya_jax.evaluation.answering import run_template

MADE_FROM = "pairs_made_from.json"


def onpolicy_records(tasks: list[instruction_tasks.Task], completions: list[str],
                     near_miss_for_correct: bool) -> list[dict]:
    """Preference records in task order: a wrong (non-empty) completion is the rejected answer;
    a right one gives the near miss instead if `near_miss_for_correct`, else no pair; a blank
    completion (the turn ended at once, or only whitespace) none, as a chat turn has content."""
    records = []
    for task, completion in zip(tasks, completions, strict=True):
        rejected = completion.strip()
        if instruction_tasks.is_correct(task, completion):
            if not near_miss_for_correct:
                continue
            rejected = task.wrong
        if rejected:
            records.append({"prompt": task.prompt_messages(),
                            "chosen": [{"role": "assistant", "content": task.answer}],
                            "rejected": [{"role": "assistant", "content": rejected}]})
    return records


def write_pairs(output: str, records: list[dict], *, tokenizer_path: str, template_path: str, ids: tuple,
                made_from: dict) -> dict:
    """OUTPUT/pairs.jsonl prepared as a preference dataset in OUTPUT (built in OUTPUT.tmp, then
    renamed) -> its manifest."""
    work = output.rstrip("/") + ".tmp"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    raw = os.path.join(work, "pairs.jsonl")
    with open(raw, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    bos, eos, pad = ids
    manifest = prepare.prepare_dataset(raw, "jsonl", tokenizer_path, work, kind="preference",
                                       chat_template=template_path, bos_id=bos, eos_id=eos, pad_id=pad,
                                       progress=False)
    prepare.write_json_atomic(os.path.join(work, MADE_FROM), made_from)
    prepare.publish(work, output)
    return manifest


def template_file(checkpoint: str, path: str | None) -> chat_template.ChatTemplate:
    """answering.run_template; a template the run recorded must still be in its file, from
    which the pairs are prepared (UserError naming it and the fix otherwise)."""
    template = run_template(checkpoint, path)
    if path is not None:
        return template
    if not (os.path.isfile(template.path) and chat_template.ChatTemplate.load(template.path).sha256 == template.sha256):
        raise UserError(f"--checkpoint {checkpoint}: the chat template it recorded, {template.path}, is gone or "
                        "changed since; pass --chat_template FILE to prepare the pairs with")
    return template
