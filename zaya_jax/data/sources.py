"""Prepared datasets (the output of zaya_jax.data.prepare) as random-access document sources.

A data config names its sources by path: a prepared directory, or `demo:<name>` for a source
of the bundled demo corpus (built on first use, see demo_corpus.py) or one of the demo's
post-training sources `demo:chat` and `demo:preference` (demo_posttrain.py). Each source is split into
a training part and a held-out part: the last `heldout_fraction` of its documents (at least
one document when the fraction is positive, and never all of them).

A source's kind (manifest "kind": text, chat or preference; text when absent) fixes what a
document is (zaya_jax/data/records.py): int32 [n] ids, or int32 [2, n] ids and mask (chat) or
ids and parts (preference).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np
from absl import logging

from zaya_jax.config import ConfigError
from zaya_jax.data import records
from zaya_jax.data.chat_template import ChatTemplate, bundled_template
from zaya_jax.errors import MissingInputError, UserError

MANIFEST = "manifest.json"
DEMO_PREFIX = "demo:"


class DocumentSource:
    """Documents [start, stop) of a prepared dataset of `kind`: `source[i]` is an int32 [n] array
    (text) or int32 [2, n] (chat: ids and mask; preference: ids and parts), see records.decode.

    The ArrayRecord reader opens lazily and is dropped on pickling, so worker processes each
    open their own.
    """

    def __init__(self, shard_paths: list[str], dtype: str, start: int, stop: int, kind: str = "text"):
        self._shard_paths, self._dtype, self._start, self._stop = shard_paths, np.dtype(dtype), start, stop
        self.kind = kind
        self._reader = None

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} out of range [0, {len(self)})")
        if self._reader is None:
            import grain  # pylint: disable=g-import-not-at-top
            self._reader = grain.sources.ArrayRecordDataSource(self._shard_paths)
        return records.decode(self.kind, self._reader[self._start + index], self._dtype)

    def __getstate__(self):
        return {**self.__dict__, "_reader": None}


@dataclasses.dataclass(frozen=True)
class PreparedSource:
    """One source of a data config: its manifest and its train / held-out document splits."""

    name: str
    path: str
    manifest: dict
    train: DocumentSource
    heldout: DocumentSource

    @property
    def kind(self) -> str:
        """text, chat or preference (the manifest's "kind"; text for datasets prepared before kinds)."""
        return self.manifest.get("kind", "text")


def heldout_count(num_documents: int, fraction: float) -> int:
    """How many trailing documents are held out: round(n*fraction), in [1, n-1] if fraction > 0."""
    if fraction <= 0 or num_documents < 2:
        return 0
    return min(num_documents - 1, max(1, round(num_documents * fraction)))


def load_manifest(path: str, field: str, made_by: str = "") -> dict:
    """Reads and checks `path`/manifest.json; errors name the config `field` and the path (a missing
    directory also the command `made_by` that writes it, '{}' standing for the path, else data.prepare)."""
    if not os.path.isdir(path):
        if made_by:
            raise MissingInputError(f"{field}: data directory {path!r} does not exist; make it first: "
                                    f"{made_by.format(path)}")
        raise MissingInputError(f"{field}: data directory {path!r} does not exist (prepare one with "
                                f"`python -m zaya_jax.data.prepare` and set {field} to it)")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise MissingInputError(f"{field}: {manifest_path!r} does not exist; {path!r} is not a finished "
                                "prepared dataset (re-run `python -m zaya_jax.data.prepare`)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{field}: {manifest_path!r} is not valid JSON ({e})") from e
    missing = [k for k in ("num_documents", "shards", "tokenizer", "dtype") if k not in manifest]
    if missing:
        raise ConfigError(f"{field}: {manifest_path!r} is not a manifest (no {', '.join(missing)})")
    if manifest["num_documents"] == 0:
        raise ConfigError(f"{field}: source {path!r} is empty (its manifest lists no documents)")
    if manifest.get("kind", "text") not in records.KINDS:
        raise ConfigError(f"{field}: {manifest_path!r} has kind {manifest['kind']!r}, not one of {records.KINDS} "
                          "(prepared by a newer zaya_jax?)")
    for shard in manifest["shards"]:
        shard_path = os.path.join(path, shard["file"])
        if not os.path.isfile(shard_path):
            raise MissingInputError(f"{field}: shard {shard_path!r} listed in the manifest does not exist")
        check_shard(shard_path, shard.get("documents"), field)
    return manifest


def check_shard(shard_path: str, documents: int | None, field: str) -> None:
    """Opens an ArrayRecord shard (its footer and index) and compares its record count with the
    manifest's, so that a damaged shard is named at start, not found mid-run. Raises InputError."""
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    from zaya_jax.data.readers import InputError  # pylint: disable=g-import-not-at-top
    try:
        reader = array_record_module.ArrayRecordReader(shard_path)
        records = reader.num_records()
        reader.close()
    except Exception as e:  # pylint: disable=broad-except  (the reader raises RuntimeError or ValueError)
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise InputError(shard_path, None, f"not a readable ArrayRecord shard ({cause}); "
                                           f"re-run `python -m zaya_jax.data.prepare` for {field}") from None
    if documents is not None and records != documents:
        raise InputError(shard_path, None, f"holds {records} records but the manifest lists {documents}; "
                                           f"re-run `python -m zaya_jax.data.prepare` for {field}")


def open_source(name: str, path: str, heldout_fraction: float, field: str, made_by: str = "") -> PreparedSource:
    manifest = load_manifest(path, field, made_by)
    shard_paths = [os.path.join(path, s["file"]) for s in manifest["shards"]]
    n = manifest["num_documents"]
    split = n - heldout_count(n, heldout_fraction)
    kind = manifest.get("kind", "text")
    return PreparedSource(name, path, manifest, DocumentSource(shard_paths, manifest["dtype"], 0, split, kind),
                          DocumentSource(shard_paths, manifest["dtype"], split, n, kind))


def open_sources(data_config, names: list[str] | None = None) -> dict[str, PreparedSource]:
    """Opens the config's sources (those in `names`, default all) and checks they agree.

    Prepared dirs are checked first; then `demo:` names are checked and the demo corpus is
    built if it is not cached yet. All sources must have
    been prepared with the same tokenizer file (same sha256); otherwise ValueError names two.
    """
    paths: Mapping[str, str] = dict(data_config.sources)
    names = list(paths) if names is None else names
    demo_names = [n for n in names if str(paths[n]).startswith(DEMO_PREFIX)]
    made_by = dict(getattr(data_config, "made_by", None) or {})
    opened = {n: open_source(n, os.path.expanduser(str(paths[n])), float(data_config.heldout_fraction),
                             f"data.sources.{n}", made_by.get(n, "")) for n in names if n not in demo_names}
    if demo_names:
        from zaya_jax.data import demo_posttrain  # pylint: disable=g-import-not-at-top
        for n in demo_names:
            if paths[n][len(DEMO_PREFIX):] not in demo_posttrain.ALL_SOURCES:
                raise ConfigError(f"data.sources.{n}: unknown demo source {paths[n]!r} "
                                 f"(known: {[DEMO_PREFIX + k for k in demo_posttrain.ALL_SOURCES]})")
        built = demo_posttrain.source_paths({paths[n][len(DEMO_PREFIX):] for n in demo_names},
                                            data_config.demo.to_dict())
        for n in demo_names:
            opened[n] = open_source(n, str(built[paths[n][len(DEMO_PREFIX):]]),
                                    float(data_config.heldout_fraction), f"data.sources.{n}")
    first = next(iter(opened.values()))
    for source in opened.values():
        if source.manifest["tokenizer"]["sha256"] != first.manifest["tokenizer"]["sha256"]:
            raise ConfigError(f"data.sources.{source.name} ({source.path}) and data.sources.{first.name} "
                             f"({first.path}) were prepared with different tokenizers")
    return opened


def chat_template_of(sources: Mapping[str, PreparedSource]) -> dict | None:
    """The chat template the sources were prepared with (their manifests' "chat_template"), as
    ChatTemplate.record(), for the run's checkpoints; None when no source recorded one (text, or
    preference pairs of plain strings). A manifest holds the template's record, text included, so the
    file may be gone (a cache prepared from another checkout). An older manifest holds its path and
    digest only: the file is read now, else the bundled template (zaya_jax/data/chat_templates/) of
    that digest. None and a warning when two sources name different templates or an older manifest's
    text is found nowhere."""
    infos = {name: s.manifest.get("chat_template") for name, s in sources.items() if s.manifest.get("chat_template")}
    if not infos:
        return None
    (first, info), *others = infos.items()
    for name, other in others:
        if other["sha256"] != info["sha256"]:
            logging.warning("data.sources.%s and data.sources.%s were prepared with different chat templates (%s, "
                            "%s): the checkpoints record none; generate --chat then needs --chat_template",
                            first, name, info["path"], other["path"])
            return None
    if "source" in info:
        return ChatTemplate.from_record(info).record()
    try:
        template = ChatTemplate.load(info["path"])
        problem = None if template.sha256 == info["sha256"] else "has changed since"
    except UserError as e:
        problem = f"cannot be read ({e})"
    if problem and (template := bundled_template(info["sha256"])) is not None:
        problem = None
    if problem:
        logging.warning("data.sources.%s was prepared with the chat template %s, which %s: the checkpoints record "
                        "none; generate --chat then needs --chat_template", first, info["path"], problem)
        return None
    return template.record()


def vocab_size(sources: Mapping[str, PreparedSource]) -> int:
    """The vocabulary size of the (one) tokenizer the sources were prepared with."""
    return next(iter(sources.values())).manifest["tokenizer"]["vocab_size"]


def tokenizer_path(data_config) -> str:
    """The config's tokenizer file; 'demo:tokenizer' builds the demo corpus if needed."""
    path = str(data_config.tokenizer)
    if path == DEMO_PREFIX + "tokenizer":
        from zaya_jax.data import demo_corpus  # pylint: disable=g-import-not-at-top
        return str(demo_corpus.build_demo_corpus(**data_config.demo.to_dict()).tokenizer)
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise MissingInputError(f"data.tokenizer: tokenizer file {path!r} does not exist")
    return path
