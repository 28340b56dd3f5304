"""The demo task set's documents, built offline from zaya_jax's own demo data (`custom_dataset`
functions of the YAMLs here; lm_eval calls them with the task's metadata).

Metadata (--metadata JSON) picks the demo corpus as a demo run's data.demo does: cache_dir
(default $ZAYA_JAX_CACHE/demo_corpus), max_docs (0: all), vocab_size, seed; and per_kind, the held-out
questions of each kind (default 100, as zaya_jax.evaluate_tasks).
"""

from __future__ import annotations

import json
import random

DOC_CHARS = 4000        # a held-out document is scored on its first DOC_CHARS characters
CLOZE_CONTEXT_LINES = 4  # lines of context before the line to pick
CLOZE_CHOICES = 4       # the true next line and 3 lines of other held-out documents


def heldout_documents(source: str, cache_dir: str = "", max_docs: int = 0, vocab_size: int = 4096, seed: int = 0,
                      **_) -> list[str]:
    """The demo corpus's held-out documents of `source` (prose, code or math): the trailing
    data.heldout_fraction of its documents, as a demo run holds them out."""
    from zaya_jax.data import demo_corpus, demo_data_config
    from zaya_jax.data.sources import heldout_count
    corpus = demo_corpus.build_demo_corpus(cache_dir or None, max_docs=max_docs, vocab_size=vocab_size, seed=seed,
                                           progress=False)
    with open(corpus.root / "raw" / f"{source}.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return texts[len(texts) - heldout_count(len(texts), demo_data_config().heldout_fraction):]


def _split(rows: list[dict]):
    import datasets
    return {"test": datasets.Dataset.from_list(rows)}


def heldout_text(source: str, **metadata):
    """{"test": Dataset of {"text"}}: each held-out document's first DOC_CHARS characters."""
    return _split([{"text": text[:DOC_CHARS]} for text in heldout_documents(source, **metadata)])


def heldout_prose(**metadata):
    return heldout_text("prose", **metadata)


def heldout_code(**metadata):
    return heldout_text("code", **metadata)


def heldout_math(**metadata):
    return heldout_text("math", **metadata)


def cloze(**metadata):
    """{"test": Dataset of {"source", "context", "choices", "answer"}}: for each held-out document
    with enough lines, CLOZE_CONTEXT_LINES lines at a seeded place, and its next line among
    CLOZE_CHOICES - 1 other lines of the source's held-out documents (at a seeded index)."""
    rows = []
    for source in ("prose", "code", "math"):
        lines_of = [[ln for ln in doc.splitlines() if ln.strip()] for doc in heldout_documents(source, **metadata)]
        pool = sorted({ln for lines in lines_of for ln in lines})
        rng = random.Random(f"cloze-{source}")
        for lines in lines_of:
            if len(lines) <= CLOZE_CONTEXT_LINES or len(pool) < CLOZE_CHOICES:
                continue
            at = rng.randrange(CLOZE_CONTEXT_LINES, len(lines))
            wrong = rng.sample([ln for ln in pool if ln != lines[at]], CLOZE_CHOICES - 1)
            answer = rng.randrange(CLOZE_CHOICES)
            rows.append({"source": source, "context": "\n".join(lines[at - CLOZE_CONTEXT_LINES:at]),
                         "choices": wrong[:answer] + [lines[at]] + wrong[answer:], "answer": answer})
    return _split(rows)


def questions(per_kind: int = 100, seed: int = 0, **_):
    """{"test": Dataset of {"kind", "question", "answer", "wrong"}}: the held-out questions of
    zaya_jax.data.instruction_tasks (none of them in the demo's SFT or DPO data)."""
    from zaya_jax.data import instruction_tasks
    return _split([{"kind": t.kind, "question": t.question, "answer": t.answer, "wrong": t.wrong}
                   for t in instruction_tasks.tasks("heldout", per_kind, seed)])


def question_exact_match(doc: dict, results: list[str]) -> dict:
    """process_results of zaya_demo_questions: the completion's first line equals the answer."""
    from zaya_jax.data import instruction_tasks
    task = instruction_tasks.Task(doc["kind"], doc["question"], doc["answer"], doc["wrong"])
    return {"exact_match": float(instruction_tasks.is_correct(task, results[0]))}
