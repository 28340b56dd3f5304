"""CLI: tokenize raw text into ArrayRecord shards of token sequences, one document per record.

    python -m zaya_jax.data.prepare --input 'raw/**/*.jsonl' --format jsonl \
        --tokenizer /models/gemma3/tokenizer.json --output /data/zaya1/web --workers 8

Flags: --input (repeatable), --format text|jsonl|parquet, --tokenizer, --output, --workers,
--num_shards, --text_field, --bos_id/--eos_id/--pad_id, --skip_bad, --quiet (dashes work too:
--num-shards). A bad input ends in one `error:` line naming the file and line, exit code 2.

Output directory:
  shard-00000-of-00016.array_record   one record per document: [bos, ids..., eos] as uint16
                                      (vocab <= 65536) or uint32, little-endian bytes
  shard-00000-of-00016.json           that shard's statistics; its presence marks the shard done
  plan.json                           the settings; a re-run with other settings is refused
  manifest.json                       inputs, tokenizer (path, sha256, vocab, special ids),
                                      dtype, documents and tokens per shard and in total

Input files (sorted) are split into contiguous groups, one per shard; shards run in parallel
worker processes; a re-run skips shards already done. A bad input (unreadable, empty, malformed
line) fails with the file and line, or with --skip_bad is skipped and counted in the manifest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import queue
from collections.abc import Callable, Sequence

import numpy as np
import tqdm
from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import readers
from zaya_jax.errors import UserError
from zaya_jax.data.tokenizer import Tokenizer, token_dtype

MANIFEST, PLAN = "manifest.json", "plan.json"
FORMAT_VERSION = 1
ENCODE_BATCH = 256  # documents per tokenizer call
MAX_LISTED_ERRORS = 20  # skipped lines listed by name per shard (all are counted)


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """Everything one worker needs to write one shard."""

    index: int
    num_shards: int
    files: tuple[str, ...]
    fmt: str
    text_field: str
    tokenizer_path: str
    special_ids: tuple[int, int, int]  # bos, eos, pad
    skip_bad: bool
    output_dir: str

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.num_shards:05d}"

    def path(self, suffix: str) -> str:
        return os.path.join(self.output_dir, self.name + suffix)


def write_json_atomic(path: str, value) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def _load_tokenizer(path: str, special_ids: tuple[int, int, int]) -> Tokenizer:
    """Loads once per process and file version (a large tokenizer.json takes a second)."""
    stat = os.stat(path)
    return _load_tokenizer_version(path, special_ids, (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _load_tokenizer_version(path: str, special_ids: tuple[int, int, int], version: tuple[int, int]) -> Tokenizer:
    del version  # part of the cache key only
    bos, eos, pad = special_ids
    return Tokenizer(path, bos_id=bos, eos_id=eos, pad_id=pad)


def run_shard(task: ShardTask, report: Callable[[int], None]) -> dict:
    """Writes one shard and its statistics file; `report(n)` is told of each n input bytes read."""
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    tok = _load_tokenizer(task.tokenizer_path, task.special_ids)
    dtype = token_dtype(tok.vocab_size)
    stats = {"file": task.name + ".array_record", "inputs": list(task.files), "documents": 0,
             "tokens": 0, "empty_documents": 0, "skipped_files": [], "skipped_lines": 0, "errors": []}

    def on_error(error: readers.InputError) -> None:
        if not task.skip_bad:
            raise error
        if error.line is None:
            stats["skipped_files"].append(str(error))
        else:
            stats["skipped_lines"] += 1
            if len(stats["errors"]) < MAX_LISTED_ERRORS:
                stats["errors"].append(str(error))

    writer = array_record_module.ArrayRecordWriter(task.path(".array_record.tmp"), "group_size:1")

    def write(texts: list[str]) -> None:
        for doc in tok.encode_documents(texts):
            writer.write(doc.astype(dtype).tobytes())
            stats["documents"] += 1
            stats["tokens"] += len(doc)

    try:
        for path in task.files:
            texts, reported = [], 0
            for doc in readers.read_documents(path, task.fmt, task.text_field, on_error):
                if not doc.text.strip():
                    stats["empty_documents"] += 1
                    continue
                texts.append(doc.text)
                if len(texts) == ENCODE_BATCH:
                    write(texts)
                    texts = []
                    report(doc.offset - reported)
                    reported = doc.offset
            write(texts)
            report(os.path.getsize(path) - reported)
    finally:
        writer.close()
    os.replace(task.path(".array_record.tmp"), task.path(".array_record"))
    write_json_atomic(task.path(".json"), stats)
    return stats


_progress_queue = None


def _init_worker(progress_queue) -> None:
    global _progress_queue
    _progress_queue = progress_queue


def _run_shard_in_worker(task: ShardTask) -> dict:
    return run_shard(task, _progress_queue.put)


def _run_parallel(tasks: Sequence[ShardTask], workers: int, bar: tqdm.tqdm) -> None:
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Queue()
    with ctx.Pool(min(workers, len(tasks)), initializer=_init_worker, initargs=(progress,)) as pool:
        result = pool.map_async(_run_shard_in_worker, tasks, chunksize=1)
        while not result.ready() or not progress.empty():
            try:
                bar.update(progress.get(timeout=0.1))
            except queue.Empty:
                pass
        result.get()  # re-raises the first worker error (an InputError names its file and line)


def prepare_dataset(inputs: str | Sequence[str], fmt: str, tokenizer_path: str, output_dir: str, *,
                    bos_id: int = 2, eos_id: int = 1, pad_id: int = 0, text_field: str = "text",
                    num_shards: int | None = None, workers: int = 1, skip_bad: bool = False,
                    progress: bool = True) -> dict:
    """Tokenizes the files matching `inputs` into `output_dir`; returns the manifest (also written)."""
    if fmt not in readers.FORMATS:
        raise ValueError(f"--format must be one of {readers.FORMATS}, got {fmt!r}")
    files = readers.expand_inputs(inputs)
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"--tokenizer {tokenizer_path!r} does not exist")
    tok = _load_tokenizer(os.path.abspath(tokenizer_path), (bos_id, eos_id, pad_id))
    num_shards = min(len(files), 64 if num_shards is None else num_shards)
    if num_shards < 1:
        raise ValueError(f"--num-shards must be positive, got {num_shards}")
    os.makedirs(output_dir, exist_ok=True)
    plan = {"format_version": FORMAT_VERSION, "format": fmt, "text_field": text_field,
            "tokenizer_sha256": tok.sha256, "special_ids": [bos_id, eos_id, pad_id], "num_shards": num_shards,
            "inputs": [[f, os.path.getsize(f)] for f in files]}
    plan_path = os.path.join(output_dir, PLAN)
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            old = json.load(f)
        changed = sorted(k for k in plan.keys() | old.keys() if plan.get(k) != old.get(k))
        if changed:
            raise ValueError(f"{output_dir} was prepared with other settings ({', '.join(changed)} differ); "
                             "use another --output or delete it")
    write_json_atomic(plan_path, plan)

    tasks = [ShardTask(i, num_shards, tuple(files[i * len(files) // num_shards:(i + 1) * len(files) // num_shards]),
                       fmt, text_field, tok.path, (bos_id, eos_id, pad_id), skip_bad, os.path.abspath(output_dir))
             for i in range(num_shards)]
    pending = [t for t in tasks if not os.path.exists(t.path(".json"))]
    total = sum(os.path.getsize(f) for t in pending for f in t.files)
    desc = f"prepare: {len(pending)} of {num_shards} shards to do"
    with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        if workers > 1 and len(pending) > 1:
            _run_parallel(pending, workers, bar)
        else:
            for task in pending:
                run_shard(task, bar.update)

    shards = []
    for task in tasks:
        with open(task.path(".json")) as f:
            shards.append(json.load(f))
    return _write_manifest(output_dir, shards, tokenizer_info=tok.info(), fmt=fmt, text_field=text_field,
                           inputs=files)


def _write_manifest(output_dir: str, shards: list[dict], *, tokenizer_info: dict, fmt: str, text_field: str,
                    inputs: list[str]) -> dict:
    manifest = {"format_version": FORMAT_VERSION, "format": fmt, "text_field": text_field, "inputs": inputs,
                "tokenizer": tokenizer_info, "dtype": token_dtype(tokenizer_info["vocab_size"]).name,
                "num_documents": sum(s["documents"] for s in shards), "num_tokens": sum(s["tokens"] for s in shards),
                "skipped_files": sum(len(s["skipped_files"]) for s in shards),
                "skipped_lines": sum(s["skipped_lines"] for s in shards), "shards": shards}
    if manifest["num_documents"] == 0:
        raise ValueError(f"no documents were written to {output_dir}: every input was empty or skipped")
    write_json_atomic(os.path.join(output_dir, MANIFEST), manifest)
    return manifest


def write_tokenized(output_dir: str, documents: Sequence[Sequence[int]], *, tokenizer_info: dict,
                    num_shards: int = 1) -> dict:
    """Writes already tokenized documents (e.g. converted from another pipeline) as a prepared dir.

    `tokenizer_info` needs at least "sha256" and "vocab_size" (see Tokenizer.info()); documents
    are written as given (include bos/eos yourself). Returns the manifest.
    """
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    os.makedirs(output_dir, exist_ok=True)
    dtype = token_dtype(tokenizer_info["vocab_size"])
    shards = []
    for i in range(num_shards):
        part = documents[i * len(documents) // num_shards:(i + 1) * len(documents) // num_shards]
        name = f"shard-{i:05d}-of-{num_shards:05d}.array_record"
        writer = array_record_module.ArrayRecordWriter(os.path.join(output_dir, name), "group_size:1")
        for doc in part:
            writer.write(np.asarray(doc, dtype=dtype).tobytes())
        writer.close()
        shards.append({"file": name, "inputs": [], "documents": len(part), "tokens": sum(len(d) for d in part),
                       "empty_documents": 0, "skipped_files": [], "skipped_lines": 0, "errors": []})
    return _write_manifest(output_dir, shards, tokenizer_info=tokenizer_info, fmt="tokenized", text_field="",
                           inputs=[])


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI (it is also a library module,
    imported by others whose processes define their own flags)."""
    flags.DEFINE_multi_string("input", None, "Glob pattern (** recurses); repeatable.", required=True)
    flags.DEFINE_enum("format", None, list(readers.FORMATS), "Input format.", required=True)
    flags.DEFINE_string("tokenizer", None, "tokenizer.json or SentencePiece .model.", required=True)
    flags.DEFINE_string("output", None, "Output directory.", required=True)
    flags.DEFINE_integer("workers", 1, "Worker processes.", lower_bound=1)
    flags.DEFINE_integer("num_shards", None, "Shards to write (default: min(#files, 64)).", lower_bound=1)
    flags.DEFINE_string("text_field", "text", "jsonl key / parquet column.")
    flags.DEFINE_integer("bos_id", 2, "From the model config (ZAYA1: 2).")
    flags.DEFINE_integer("eos_id", 1, "From the model config (ZAYA1: 1).")
    flags.DEFINE_integer("pad_id", 0, "From the model config (ZAYA1: 0).")
    flags.DEFINE_bool("skip_bad", False, "Skip and count bad files/lines instead of failing.")
    flags.DEFINE_bool("quiet", False, "No progress bar.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        manifest = prepare_dataset(f.input, f.format, f.tokenizer, f.output, bos_id=f.bos_id, eos_id=f.eos_id,
                                   pad_id=f.pad_id, text_field=f.text_field, num_shards=f.num_shards,
                                   workers=f.workers, skip_bad=f.skip_bad, progress=not f.quiet)
    except (FileNotFoundError, ValueError) as err:  # an InputError is a UserError already
        raise UserError(str(err)) from err
    summary = {k: manifest[k] for k in ("num_documents", "num_tokens", "skipped_files", "skipped_lines", "dtype")}
    print(json.dumps({"output": f.output, "shards": len(manifest["shards"]), **summary}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
