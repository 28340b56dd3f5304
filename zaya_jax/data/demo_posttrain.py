"""The demo's post-training sources, `demo:chat` and `demo:preference` (and the vision-language
demo's `demo:digits`, zaya_jax.data.vision.demo_source): built offline on first use.

  chat        SFT conversations (a user question, the assistant's correct answer) of the
              generated instruction tasks (instruction_tasks.py), prepared with kind "chat"
  preference  DPO pairs of the same questions: chosen = the correct answer, rejected = a
              plausible wrong one, prepared with kind "preference"

Both are rendered with the plain chat template (chat_templates/plain.jinja) and tokenized with
the demo corpus's tokenizer (built first if needed). Each source holds 1900 training tasks of
every kind followed by 100 held-out tasks of every kind (task_counts), so a data config with
`heldout_fraction = HELDOUT_FRACTION` evaluates on exactly the held-out questions, none of
which the training part contains (`python -m zaya_jax.evaluate_tasks` scores the same ones by
generation).

Cache: next to the demo corpus it tokenizes with, <cache_dir>/<corpus key>-posttrain-v<N>-...,
built under the same lock-and-rename scheme (demo_corpus.build_once); the corpus's own cache
entry is untouched.
"""

from __future__ import annotations

import json
import os
import pathlib

import ml_collections

from zaya_jax.data import chat_template, curriculum, demo_corpus, instruction_tasks, prepare, tokenizer

BUILD_VERSION = 2
SOURCES = {"chat": "chat", "preference": "preference"}  # source name -> prepared dataset kind
VISION_SOURCES = ("digits",)  # image_chat sources (zaya_jax.data.vision.demo_source)
ALL_SOURCES = (*demo_corpus.SOURCES, *SOURCES, *VISION_SOURCES)  # every name `demo:<name>` may take
HELDOUT_PER_KIND = 100
TRAIN_PER_HELDOUT = 19  # training tasks per held-out one
HELDOUT_FRACTION = 1 / (TRAIN_PER_HELDOUT + 1)  # 0.05: the trailing 500 of 10000 documents


def task_counts(max_docs: int = 0) -> tuple[int, int]:
    """(training, held-out) tasks per kind: (1900, 100), or (19, 1) for a capped demo corpus
    (data.demo.max_docs > 0, as tests build it)."""
    heldout = 1 if max_docs else HELDOUT_PER_KIND
    return TRAIN_PER_HELDOUT * heldout, heldout


def records(seed: int = 0, max_docs: int = 0) -> dict[str, list[dict]]:
    """Each source's JSONL records: the training tasks, then the held-out ones (task_counts)."""
    train, heldout = task_counts(max_docs)
    tasks = instruction_tasks.tasks("train", train, seed) + instruction_tasks.tasks("heldout", heldout, seed)
    return {"chat": [t.chat_record() for t in tasks], "preference": [t.preference_record() for t in tasks]}


def build_posttrain_sources(cache_dir: str | os.PathLike | None = None, *, max_docs: int = 0,
                            vocab_size: int = 4096, seed: int = 0, progress: bool = True) -> dict[str, pathlib.Path]:
    """Builds `demo:chat` and `demo:preference` unless cached -> {name: prepared dir}.

    The settings are the demo corpus's (data.demo); its tokenizer prepares both sources."""
    corpus = demo_corpus.build_demo_corpus(cache_dir, max_docs=max_docs, vocab_size=vocab_size, seed=seed,
                                           progress=progress)
    template_digest = tokenizer.file_sha256(chat_template.PLAIN)[:12]
    key = (f"{corpus.root.name}-posttrain-v{BUILD_VERSION}-tasks{'+'.join(map(str, task_counts(max_docs)))}"
           f"-template{template_digest}")

    def build(work: pathlib.Path) -> dict:
        (work / "raw").mkdir()
        stats = {}
        for name, source_records in records(seed, max_docs).items():
            raw = work / "raw" / f"{name}.jsonl"
            raw.write_text("".join(json.dumps(r) + "\n" for r in source_records), encoding="utf-8")
            manifest = prepare.prepare_dataset(str(raw), "jsonl", str(corpus.tokenizer), str(work / name),
                                               progress=False, kind=SOURCES[name], chat_template=chat_template.PLAIN)
            stats[name] = {"documents": manifest["num_documents"], "tokens": manifest["num_tokens"]}
        return stats

    final = demo_corpus.build_once(corpus.root.parent, key, build)
    return {name: final / name for name in SOURCES}


def source_paths(names: set[str], demo_settings: dict) -> dict[str, pathlib.Path]:
    """Prepared dirs of demo sources `names` (each in ALL_SOURCES), building what is not cached.

    demo_settings: a data config's `demo` section (cache_dir, max_docs, vocab_size, seed)."""
    paths: dict[str, pathlib.Path] = {}
    if names & set(demo_corpus.SOURCES):
        paths.update(demo_corpus.build_demo_corpus(**demo_settings).sources)
    if names & set(SOURCES):
        paths.update(build_posttrain_sources(**demo_settings))
    if "digits" in names:
        from zaya_jax.data.vision.demo_source import build_digit_source
        paths["digits"] = build_digit_source(**demo_settings)
    return {name: paths[name] for name in names}


def data_config(source: str, steps: int, *, path: str = "", batch: int = 16, seq_len: int = 128,
                rope_theta: float = 1e5):
    """The demo data config (curriculum.demo_data_config: tokenizer, demo settings) reduced to one
    phase of `steps` batches [batch, seq_len] on the source `source` (at `path`, default
    `demo:<source>`), evaluated on all its held-out examples (the trailing HELDOUT_FRACTION: for
    demo sources, the held-out questions)."""
    config = curriculum.demo_data_config()
    config.sources = ml_collections.ConfigDict({source: path or f"demo:{source}"})
    config.heldout_fraction = HELDOUT_FRACTION
    config.phases = (ml_collections.ConfigDict(dict(
        name=source, token_budget=steps * batch * seq_len, seq_len=seq_len, rope_theta=rope_theta,
        global_batch_size=batch, weights={source: 1.0})),)
    config.eval.update(seq_len=seq_len, batch_size=batch, max_batches=0)
    return config


def stage_config(config, source: str, steps: int, *, objective: str, init_from: str, made_by: str,
                 learning_rate: float, path: str = "", path_made_by: str = ""):
    """A full config (configs/demo.py's model and trainer) turned into one post-training stage:
    `steps` batches of `source` (data_config, at `path`, written by the command `path_made_by`, '{}'
    its path) with `objective`, starting from the run `init_from` (trained by the command `made_by`)
    with a fresh cosine schedule peaking at `learning_rate`; one checkpoint at the end, two
    evaluations on all held-out data."""
    config.data = data_config(source, steps, path=path)
    if path_made_by:
        config.data.made_by = ml_collections.ConfigDict({source: path_made_by})
    config.train.update(steps=steps, objective=objective, init_from_checkpoint=init_from,
                        init_from_checkpoint_made_by=made_by)
    config.optimizer.update(learning_rate=learning_rate, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    config.checkpoint.update(every_steps=steps, max_to_keep=1)
    config.eval.update(every_steps=steps // 2, max_batches=0)
    return config
