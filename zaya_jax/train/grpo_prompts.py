"""GRPO's prompts: what the policy answers, with the columns its rewards check (grpo.prompts,
grpo.eval_prompts).

  demo:tasks           the demo's training questions (zaya_jax.data.instruction_tasks, the 'train'
                       split: those demo:chat holds, demo_posttrain.task_counts), column `answer`
  demo:tasks_heldout   its held-out questions (never in demo:tasks), column `answer`
  FILE.jsonl           one record a line, TRL's prompt-only format: {"prompt": "text" or
                       [{"role", "content"}, ...], any other columns}; every record has the same keys

A conversational prompt is rendered with the chat template and its generation prompt
(chat_template.encode_prompt: what a chat user sends); a text prompt is bos + its tokens. Reward
functions receive the prompt as written (the messages, or the text). Every prompt must fit in
grpo.max_prompt_length tokens: a longer one is named, before anything compiles.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data import chat_template, demo_posttrain, instruction_tasks

DEMO_SPLITS = {"demo:tasks": "train", "demo:tasks_heldout": "heldout"}


class PromptSet(NamedTuple):
    ids: list[np.ndarray]          # int32 [n_i] each: the tokens the policy continues
    prompts: list                  # what reward functions receive: messages or text
    columns: dict[str, list]       # the other fields, one value per prompt


def demo_records(split: str, max_docs: int, seed: int) -> list[dict]:
    """The demo's instruction tasks of `split` as prompt-only records with an `answer` column."""
    per_kind = demo_posttrain.task_counts(max_docs)[split == "heldout"]
    return [{"prompt": task.prompt_messages(), "answer": task.answer}
            for task in instruction_tasks.tasks(split, per_kind, seed)]


def jsonl_records(path: str, field: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ConfigError(f"{field}: {path!r} is not a file (a JSONL of prompt records, or 'demo:tasks')")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{field}: {path} line {number} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ConfigError(f"{field}: {path} line {number} has no \"prompt\" field")
            if records and set(record) != set(records[0]):
                raise ConfigError(f"{field}: {path} line {number} has the fields {sorted(record)}, the first record "
                                  f"{sorted(records[0])}: every record needs the same columns")
            records.append(record)
    if not records:
        raise ConfigError(f"{field}: {path} holds no prompt")
    return records


def load_prompts(spec: str, field: str, tokenizer, template: chat_template.ChatTemplate, max_prompt_length: int,
                 demo_settings: dict) -> PromptSet:
    """The prompts `spec` names (the module's table), tokenized; ConfigError naming `field` for a
    missing file, a bad record or a prompt longer than max_prompt_length."""
    if spec in DEMO_SPLITS:
        records = demo_records(DEMO_SPLITS[spec], demo_settings.get("max_docs", 0), demo_settings.get("seed", 0))
    else:
        records = jsonl_records(os.path.expanduser(spec), field)
    ids = []
    for number, record in enumerate(records, 1):
        prompt = record["prompt"]
        if isinstance(prompt, str):
            tokens = np.asarray([tokenizer.bos_id, *tokenizer.encode(prompt)], np.int32)
        else:
            try:
                tokens = chat_template.encode_prompt(template, tokenizer, prompt)
            except chat_template.ConversationError as err:
                raise ConfigError(f"{field}: prompt {number} of {spec}: {err} (or give the prompt as text)") from None
        if len(tokens) > max_prompt_length:
            raise ConfigError(f"{field}: prompt {number} of {spec} has {len(tokens)} tokens, more than "
                              f"grpo.max_prompt_length={max_prompt_length}; raise it or shorten the prompt")
        ids.append(tokens)
    columns = {k: [r[k] for r in records] for k in records[0] if k != "prompt"}
    return PromptSet(ids, [r["prompt"] for r in records], columns)
