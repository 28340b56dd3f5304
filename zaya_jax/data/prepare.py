r"""CLI: tokenize raw text into ArrayRecord shards of token sequences, one document per record.

    python -m zaya_jax.data.prepare --input 'raw/**/*.jsonl' --format jsonl \
        --tokenizer /models/gemma3/tokenizer.json --output /data/zaya1/web --workers 8
    python -m zaya_jax.data.prepare --kind chat --input 'sft/*.jsonl' --format jsonl \
        --tokenizer tok.json --chat_template zaya_jax/data/chat_templates/plain.jinja --output /data/sft
    python -m zaya_jax.data.prepare --kind image_chat --input 'vl/*.jsonl' --format jsonl \
        --tokenizer tok.json --chat_template plain.jinja --vision_config configs/demo_vl.py --output /data/vl

Flags: --input (repeatable), --format text|jsonl|parquet, --kind text|chat|preference|image_chat,
--tokenizer, --chat_template, --vision_config, --output, --workers, --num_shards, --text_field, --messages_field,
--bos_id/--eos_id/--pad_id, --skip_bad, --quiet (dashes work too: --num-shards). A bad input
ends in one `error:` line naming the file and line, exit code 2.

Kinds (records: zaya_jax/data/records.py): text documents [bos, ids..., eos]; chat conversations
(a `messages` list of {role, content}) as ids and a mask of the assistant tokens; preference
pairs (`prompt`, `chosen`, `rejected`: strings, or lists of messages rendered with the chat
template) as prompt, chosen and rejected ids; image_chat conversations with images, TRL's
vision-language format (`messages` whose contents may hold {"type": "image"} parts, and `images`:
the image files, relative to the input file's directory, in the order of those parts) as ids
with each image's span, the mask, and the images resized by the processor of --vision_config (a
config file with a vision section: the tower's patches, image token ids and min/max pixels;
zaya_jax.data.vision.chat). The chat template (zaya_jax/data/chat_template.py) is --chat_template,
else the `chat_template` of the tokenizer_config.json beside --tokenizer.

Output directory:
  shard-00000-of-00016.array_record   one record per document, ids as uint16 (vocab <= 65536)
                                      or uint32, little-endian bytes
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
import pathlib
import queue
from collections.abc import Callable, Sequence

import tqdm
from absl import app, flags

from zaya_jax import cli
from zaya_jax.data import chat_template as templates
from zaya_jax.data import readers, records
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
    text_field: str  # the text field (text) or the messages field (chat)
    tokenizer_path: str
    special_ids: tuple[int, int, int]  # bos, eos, pad
    skip_bad: bool
    output_dir: str
    kind: str = "text"
    template_path: str | None = None
    vision_config_path: str | None = None  # image_chat: the config file whose vision section sizes the images

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


def publish(work: str | os.PathLike, final: str | os.PathLike) -> None:
    """Renames a directory built in `work` (prepared datasets in it or below) to `final`, once the
    paths its JSON files record (manifests and plans name their inputs and shards) name `final`
    instead; tokenizer.json files are left as they are."""
    work, final = os.path.abspath(work), os.path.abspath(final)
    for path in pathlib.Path(work).rglob("*.json"):
        if path.name != "tokenizer.json":
            path.write_text(path.read_text().replace(work, final))
    os.rename(work, final)


def _load_tokenizer(path: str, special_ids: tuple[int, int, int]) -> Tokenizer:
    """Loads once per process and file version (a large tokenizer.json takes a second)."""
    stat = os.stat(path)
    return _load_tokenizer_version(path, special_ids, (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _load_tokenizer_version(path: str, special_ids: tuple[int, int, int], version: tuple[int, int]) -> Tokenizer:
    del version  # part of the cache key only
    bos, eos, pad = special_ids
    return Tokenizer(path, bos_id=bos, eos_id=eos, pad_id=pad)


@functools.lru_cache(maxsize=2)
def _load_template(path: str | None) -> templates.ChatTemplate | None:
    return None if path is None else templates.ChatTemplate.load(path)


def _shard_stats(task_name: str, inputs: Sequence[str], kind: str) -> dict:
    extra = {"chat": {"supervised_tokens": 0}, "preference": {"pairs": 0},
             "image_chat": {"supervised_tokens": 0, "images": 0}}.get(kind, {})
    return {"file": task_name + ".array_record", "inputs": list(inputs), "documents": 0, "tokens": 0, **extra,
            "empty_documents": 0, "skipped_files": [], "skipped_lines": 0, "errors": []}


def _add_document(stats: dict, kind: str, document) -> None:
    stats["documents"] += 1
    for key, value in records.statistics(kind, document).items():
        stats[key] += value


def _record_encoder(task: ShardTask, tok: Tokenizer, path: str) -> tuple[readers.Fields, Callable[[dict], object]]:
    """The fields a chat / preference / image_chat record of input file `path` needs and how its
    values become a document."""
    template = _load_template(task.template_path)
    if task.kind == "image_chat":
        from zaya_jax.data.vision.chat import image_chat_encoder
        return ({task.text_field: (list,), "images": (list,)},
                image_chat_encoder(template, tok, task.vision_config_path, os.path.dirname(path), task.text_field))
    if task.kind == "chat":
        return ({task.text_field: (list,)},
                lambda values: templates.encode_conversation(template, tok, values[task.text_field]))
    return ({name: (str, list) for name in ("prompt", "chosen", "rejected")},
            lambda values: templates.encode_preference(template, tok, **values))


def run_shard(task: ShardTask, report: Callable[[int], None]) -> dict:
    """Writes one shard and its statistics file; `report(n)` is told of each n input bytes read."""
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    tok = _load_tokenizer(task.tokenizer_path, task.special_ids)
    dtype = token_dtype(tok.vocab_size)
    stats = _shard_stats(task.name, task.files, task.kind)

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
            writer.write(records.encode("text", doc, dtype))
            _add_document(stats, "text", doc)

    try:
        _write_shard(task, tok, write, writer, stats, on_error, report)
    except BaseException:
        writer.close()
        os.remove(task.path(".array_record.tmp"))  # a failed shard leaves nothing behind
        raise
    writer.close()
    os.replace(task.path(".array_record.tmp"), task.path(".array_record"))
    write_json_atomic(task.path(".json"), stats)
    return stats


def _write_shard(task: ShardTask, tok: Tokenizer, write: Callable[[list[str]], None], writer, stats: dict,
                 on_error: readers.ErrorHandler, report: Callable[[int], None]) -> None:
    """Every input file of `task` through `write` (text) or into `writer` (chat, preference)."""
    dtype = token_dtype(tok.vocab_size)
    for path in task.files:
        if task.kind != "text":
            _write_records(task, tok, path, lambda doc: writer.write(records.encode(task.kind, doc, dtype)),
                           stats, on_error)
            report(os.path.getsize(path))
            continue
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


def _write_records(task: ShardTask, tok: Tokenizer, path: str, write: Callable[[object], None], stats: dict,
                   on_error: readers.ErrorHandler) -> None:
    """The chat / preference records of one input file; a record the template cannot encode is a
    bad line (templates.ConversationError), named by file and line."""
    fields, encode = _record_encoder(task, tok, path)
    for record in readers.read_records(path, task.fmt, fields, on_error):
        try:
            document = encode(record.values)
        except templates.ConversationError as e:
            on_error(readers.InputError(path, record.line, str(e)))
            continue
        write(document)
        _add_document(stats, task.kind, document)


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


def default_chat_template(tokenizer_path: str) -> str | None:
    """The tokenizer_config.json beside the tokenizer file, if it has a `chat_template`."""
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
    try:
        with open(path) as f:
            return path if "chat_template" in json.load(f) else None
    except (OSError, ValueError, TypeError):
        return None


def resolve_chat_template(kind: str, chat_template_path: str | None, tokenizer_path: str) -> str | None:
    """The template file a kind needs: the one given, else the tokenizer's; chat needs one."""
    if kind == "text":
        return None
    if chat_template_path is not None:
        return chat_template_path
    found = default_chat_template(tokenizer_path)
    if found is None and kind in ("chat", "image_chat"):
        beside = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
        state = "has no \"chat_template\"" if os.path.isfile(beside) else "does not exist"
        raise UserError(f"--kind {kind} needs a chat template and {beside} {state}: pass --chat_template FILE "
                        f"(a .jinja file, e.g. {templates.PLAIN}, or a tokenizer_config.json), or put a "
                        "tokenizer_config.json with a \"chat_template\" beside --tokenizer")
    return found


def prepare_dataset(inputs: str | Sequence[str], fmt: str, tokenizer_path: str, output_dir: str, *,
                    kind: str = "text", chat_template: str | None = None, vision_config: str | None = None,
                    bos_id: int = 2, eos_id: int = 1, pad_id: int = 0, text_field: str = "text",
                    messages_field: str = "messages", num_shards: int | None = None, workers: int = 1,
                    skip_bad: bool = False, progress: bool = True) -> dict:
    """Tokenizes the files matching `inputs` into `output_dir`; returns the manifest (also written).

    kind: "text" (documents), "chat" (conversations in `messages_field`, masked by the template)
    "preference" (prompt/chosen/rejected) or "image_chat" (conversations in `messages_field` with
    their `images`, sized by the vision section of the config file `vision_config`);
    `chat_template`: a .jinja or tokenizer_config.json path (default: the tokenizer_config.json
    beside the tokenizer, if it has a chat_template).
    """
    if fmt not in readers.FORMATS:
        raise ValueError(f"--format must be one of {readers.FORMATS}, got {fmt!r}")
    if kind not in records.KINDS:
        raise ValueError(f"--kind must be one of {records.KINDS}, got {kind!r}")
    vision = None
    if kind == "image_chat":
        from zaya_jax.data.vision.chat import vision_section_of
        vision = vision_section_of(vision_config)
    elif vision_config is not None:
        raise UserError(f"--vision_config sizes the images of --kind image_chat; --kind {kind} has none")
    if kind != "text" and fmt == "text":
        raise ValueError(f"--kind {kind} reads one record per line or row: use --format jsonl or parquet")
    files = readers.expand_inputs(inputs)
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"--tokenizer {tokenizer_path!r} does not exist")
    tok = _load_tokenizer(os.path.abspath(tokenizer_path), (bos_id, eos_id, pad_id))
    template_path = resolve_chat_template(kind, chat_template, tokenizer_path)
    template = None if template_path is None else _load_template(os.path.abspath(template_path))
    field = messages_field if kind in ("chat", "image_chat") else text_field
    num_shards = min(len(files), 64 if num_shards is None else num_shards)
    if num_shards < 1:
        raise ValueError(f"--num-shards must be positive, got {num_shards}")
    plan_path = os.path.join(output_dir, PLAN)
    created = {"output": not os.path.exists(output_dir), "plan": not os.path.exists(plan_path)}
    os.makedirs(output_dir, exist_ok=True)
    plan = {"format_version": FORMAT_VERSION, "format": fmt, "kind": kind, "text_field": field,
            "tokenizer_sha256": tok.sha256, "special_ids": [bos_id, eos_id, pad_id], "num_shards": num_shards,
            "chat_template_sha256": template and template.sha256,
            "inputs": [[f, os.path.getsize(f)] for f in files]} | ({"vision": vision} if vision else {})
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            old = {"kind": "text", "chat_template_sha256": None, **json.load(f)}  # older plans: text
        changed = sorted(k for k in plan.keys() | old.keys() if plan.get(k) != old.get(k))
        if changed:
            raise ValueError(f"{output_dir} was prepared with other settings ({', '.join(changed)} differ); "
                             "use another --output or delete it")
    write_json_atomic(plan_path, plan)

    tasks = [ShardTask(i, num_shards, tuple(files[i * len(files) // num_shards:(i + 1) * len(files) // num_shards]),
                       fmt, field, tok.path, (bos_id, eos_id, pad_id), skip_bad, os.path.abspath(output_dir), kind,
                       template and template.path, vision_config and os.path.abspath(vision_config))
             for i in range(num_shards)]
    pending = [t for t in tasks if not os.path.exists(t.path(".json"))]
    total = sum(os.path.getsize(f) for t in pending for f in t.files)
    desc = f"prepare: {len(pending)} of {num_shards} shards to do"
    try:
        with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
            if workers > 1 and len(pending) > 1:
                _run_parallel(pending, workers, bar)
            else:
                for task in pending:
                    run_shard(task, bar.update)
    except BaseException:
        _undo_start(output_dir, plan_path, created, tasks)
        raise

    shards = []
    for task in tasks:
        with open(task.path(".json")) as f:
            shards.append(json.load(f))
    template_info = template and template.record()
    return _write_manifest(output_dir, shards, tokenizer_info=tok.info(), fmt=fmt, text_field=field,
                           inputs=files, kind=kind, template_info=template_info)


def _undo_start(output_dir: str, plan_path: str, created: dict[str, bool], tasks: list[ShardTask]) -> None:
    """After a failure with no shard done: the plan.json (and the output directory) this run created go,
    so the output is as it was (failed shards remove their own files; done shards stay, a re-run skips them)."""
    if any(os.path.exists(t.path(".json")) for t in tasks):
        return
    if created["plan"] and os.path.exists(plan_path):
        os.remove(plan_path)
    if created["output"] and not os.listdir(output_dir):
        os.rmdir(output_dir)


def _write_manifest(output_dir: str, shards: list[dict], *, tokenizer_info: dict, fmt: str, text_field: str,
                    inputs: list[str], kind: str, template_info: dict | None) -> dict:
    """manifest.json: the shards' statistics summed (supervised tokens for chat, pairs for preference)."""
    manifest = {"format_version": FORMAT_VERSION, "format": fmt, "kind": kind, "text_field": text_field,
                "inputs": inputs, "tokenizer": tokenizer_info, "chat_template": template_info,
                "dtype": token_dtype(tokenizer_info["vocab_size"]).name,
                "num_documents": sum(s["documents"] for s in shards), "num_tokens": sum(s["tokens"] for s in shards),
                "skipped_files": sum(len(s["skipped_files"]) for s in shards),
                "skipped_lines": sum(s["skipped_lines"] for s in shards), "shards": shards}
    for stat in {"chat": ("supervised_tokens",), "preference": ("pairs",),
                 "image_chat": ("supervised_tokens", "images")}.get(kind, ()):
        manifest["num_" + stat] = sum(s[stat] for s in shards)
    if manifest["num_documents"] == 0:
        raise ValueError(f"no documents were written to {output_dir}: every input was empty or skipped")
    write_json_atomic(os.path.join(output_dir, MANIFEST), manifest)
    return manifest


def write_tokenized(output_dir: str, documents: Sequence, *, tokenizer_info: dict, num_shards: int = 1,
                    kind: str = "text", chat_template: templates.ChatTemplate | None = None) -> dict:
    """Writes already tokenized documents (e.g. converted from another pipeline) as a prepared dir.

    `tokenizer_info` needs at least "sha256" and "vocab_size" (see Tokenizer.info()); documents
    are written as given (include bos/eos yourself): text `[ids]`, chat `[(ids, mask)]`,
    preference `[(prompt_ids, chosen_ids, rejected_ids)]`, image_chat `[(ids, mask, images)]`.
    `chat_template`: the template the conversations were rendered with (the manifest records it,
    and a run trained on them its checkpoints: generation renders prompts with it). Returns the manifest.
    """
    if kind not in records.KINDS:
        raise ValueError(f"kind must be one of {records.KINDS}, got {kind!r}")
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    os.makedirs(output_dir, exist_ok=True)
    dtype = token_dtype(tokenizer_info["vocab_size"])
    shards = []
    for i in range(num_shards):
        part = documents[i * len(documents) // num_shards:(i + 1) * len(documents) // num_shards]
        name = f"shard-{i:05d}-of-{num_shards:05d}.array_record"
        writer = array_record_module.ArrayRecordWriter(os.path.join(output_dir, name), "group_size:1")
        stats = _shard_stats(name.removesuffix(".array_record"), [], kind)
        for doc in part:
            writer.write(records.encode(kind, doc, dtype))
            _add_document(stats, kind, doc)
        writer.close()
        shards.append(stats)
    template_info = chat_template and chat_template.record()
    return _write_manifest(output_dir, shards, tokenizer_info=tokenizer_info, fmt="tokenized", text_field="",
                           inputs=[], kind=kind, template_info=template_info)


def define_flags() -> None:
    """The CLI's flags, defined only when this module runs as the CLI (it is also a library module,
    imported by others whose processes define their own flags)."""
    flags.DEFINE_multi_string("input", None, "Glob pattern (** recurses); repeatable.", required=True)
    flags.DEFINE_enum("format", None, list(readers.FORMATS), "Input format.", required=True)
    flags.DEFINE_enum("kind", "text", list(records.KINDS),
                      "text documents, chat conversations, preference pairs or image_chat conversations with images.")
    flags.DEFINE_string("vision_config", None, "--kind image_chat: a config file with a vision section (the run's, "
                                               "e.g. configs/demo_vl.py), which sizes the images.")
    flags.DEFINE_string("chat_template", None, "Chat template: a .jinja file or a tokenizer_config.json (default: "
                                               "the tokenizer_config.json beside --tokenizer).")
    flags.DEFINE_string("messages_field", "messages", "jsonl key / parquet column of a chat's messages.")
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
        manifest = prepare_dataset(f.input, f.format, f.tokenizer, f.output, kind=f.kind, chat_template=f.chat_template,
                                   vision_config=f.vision_config,
                                   bos_id=f.bos_id, eos_id=f.eos_id, pad_id=f.pad_id, text_field=f.text_field,
                                   messages_field=f.messages_field, num_shards=f.num_shards, workers=f.workers,
                                   skip_bad=f.skip_bad, progress=not f.quiet)
    except readers.InputError as err:
        raise UserError(f"{err}\n(--skip_bad skips bad files and lines and counts them in the manifest)") from err
    except (FileNotFoundError, ValueError) as err:
        raise UserError(str(err)) from err
    summary = {k: manifest[k] for k in ("kind", "num_documents", "num_tokens", "num_supervised_tokens", "num_pairs",
                                        "num_images", "skipped_files", "skipped_lines", "dtype") if k in manifest}
    print(json.dumps({"output": f.output, "shards": len(manifest["shards"]), **summary}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
