"""Checksums of a checkpoint step directory, written as part of Orbax's commit, checked before restoring.

  write_manifest(step_dir, kind, parts=None)
                                   step_dir/zaya_manifest.json: {kind, items, files: {relative path:
                                   [size, crc32]}, shares} of every file Orbax wrote; written
                                   (atomically, by renaming a temporary file) into Orbax's temporary
                                   directory once every item is final, before Orbax commits the step
                                   by renaming that directory (sealing.py), so a step directory
                                   without a valid manifest was not written by this version's
                                   trainer. `parts`: the checksums of each process's share (their
                                   union must be every file), else checksummed here
  file_sizes(step_dir)             {relative path: size} of the files a manifest lists
  checksums(step_dir, sizes, index, count)
                                   {relative path: [size, crc32]} of share `index` of `count`: the
                                   files of `sizes` dealt out by size, so that every process of a
                                   job reads about as many bytes (each is given the same `sizes`)
  problem(step_dir, items)         None if `items` of the step are whole, else why not (one line,
                                   naming the file): no or unreadable manifest, an item missing, a
                                   file missing, of another size, or with another crc32
  newest_whole_step(directory, items, step=None)
                                   the newest step (or exactly `step`) whose `items` are whole,
                                   and [(step, problem)] of the newer steps passed over

kind: "training" (items model, train, data, config: the trainer's checkpoints), "model"
(model, config: `convert to_orbax` and `save_model`) or "local" (state, data: one process's shards
in the local tier, local_tier.py). A training checkpoint missing its `train`
item is damaged, never mistaken for a model-only one. A DPO run's checkpoints also hold the
optional item `reference` (the frozen reference model), and a run with a tokenizer the optional
`tokenizer` (a copy of its file, carried_tokenizer.py); the manifest's `items` lists what the
step holds.
"""

from __future__ import annotations

import json
import os
import zlib

MANIFEST = "zaya_manifest.json"
# What Orbax writes at the top of a step when it commits it, after the manifest: the commit timestamp
# (an update of _CHECKPOINT_METADATA) and the commit marker. Not listed (older manifests list them).
COMMIT_RECORDS = ("_CHECKPOINT_METADATA", "commit_success.txt")
ITEMS = {"training": ("model", "train", "data", "config"), "model": ("model", "config"),
         "local": ("state", "data")}
OPTIONAL_ITEMS = ("reference", "tokenizer")
_CHUNK = 1 << 22


def crc32(path: str) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out.extend(os.path.relpath(os.path.join(root, n), step_dir) for n in names)
    return sorted(p for p in out if p != MANIFEST and p not in COMMIT_RECORDS)


def _share(sizes: dict[str, int], index: int, count: int) -> list[str]:
    """The files of share `index`: largest first, each to the share with the fewest bytes so far."""
    loads, mine = [0] * count, []
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        owner = loads.index(min(loads))
        loads[owner] += sizes[rel]
        if owner == index:
            mine.append(rel)
    return mine


def file_sizes(step_dir: str) -> dict[str, int]:
    """{relative path: size} of the files under `step_dir` that a manifest lists."""
    return {rel: os.path.getsize(os.path.join(step_dir, rel)) for rel in _files(step_dir)}


def checksums(step_dir: str, sizes: dict[str, int] | None = None, index: int = 0,
              count: int = 1) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of share `index` of `count` of the files of `sizes` (default:
    every file under `step_dir`)."""
    sizes = file_sizes(step_dir) if sizes is None else sizes
    return {rel: [sizes[rel], crc32(os.path.join(step_dir, rel))] for rel in _share(sizes, index, count)}


def write_manifest(step_dir: str, kind: str, parts: list[dict[str, list[int]]] | None = None) -> None:
    """Records size and crc32 of every file under `step_dir` (an Orbax step directory whose items are
    final): the union of `parts` (one per process: `checksums` of its share), or all checksummed here."""
    missing = [item for item in ITEMS[kind] if not os.path.isdir(os.path.join(step_dir, item))]
    if missing:
        raise RuntimeError(f"{step_dir}: Orbax finished the step without item(s) {', '.join(missing)}")
    parts = parts if parts is not None else [checksums(step_dir)]
    files = dict(sorted((rel, entry) for part in parts for rel, entry in part.items()))
    if list(files) != _files(step_dir) or sum(map(len, parts)) != len(files):
        raise RuntimeError(f"{step_dir}: the processes' checksums do not cover its files exactly once "
                           f"({len(files)} checksummed of {len(_files(step_dir))})")
    items = list(ITEMS[kind]) + [item for item in OPTIONAL_ITEMS if os.path.isdir(os.path.join(step_dir, item))]
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"kind": kind, "items": items, "files": files, "shares": [len(p) for p in parts]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def read_manifest(step_dir: str) -> dict:
    """The manifest of `step_dir`; ValueError (naming why) when it is absent or unreadable."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(step_dir, COMMIT_RECORDS[1])):
            raise ValueError(f"no {MANIFEST}, though Orbax committed the step (written by another tool, or by "
                             "a zaya_jax before 2026-12 stopped between Orbax's commit and its manifest)")
        raise ValueError(f"no {MANIFEST} and no Orbax commit marker (not a finished save)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest["kind"] not in ITEMS or not isinstance(manifest["files"], dict):
            raise ValueError(f"kind {manifest['kind']!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    return manifest


def kind_of(step_dir: str) -> str:
    return read_manifest(step_dir)["kind"]


def items_of(step_dir: str) -> list[str]:
    """The items the step holds (its kind's, plus any of OPTIONAL_ITEMS)."""
    return list(read_manifest(step_dir)["items"])


def problem(step_dir: str, items: tuple[str, ...]) -> str | None:
    """Why `items` of `step_dir` cannot be restored, or None when every file of them is intact.

    Checks the files of the requested items and the step's own top-level files; `items` that the
    checkpoint lacks (e.g. `train` of a model-only export, `reference` of a non-DPO run) are left
    out, since the caller asks `kind_of` / `items_of` what it holds.
    """
    try:
        manifest = read_manifest(step_dir)
    except ValueError as e:
        return str(e)
    wanted = [item for item in items if item in manifest.get("items", ITEMS[manifest["kind"]])]
    for item in wanted:
        if not os.path.isdir(os.path.join(step_dir, item)):
            return f"item {item!r} is missing"
    for rel, (size, checksum) in manifest["files"].items():
        top = rel.split(os.sep, 1)[0]
        if os.sep in rel and top not in wanted:
            continue
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path)} bytes, {size} were written"
        if crc32(path) != checksum:
            return f"{rel} fails its checksum (crc32 {crc32(path):08x}, {checksum:08x} written)"
    return None


def steps_in(directory: str) -> list[int]:
    """Finished step directories (integer names) in `directory`, newest first."""
    if not os.path.isdir(directory):
        return []
    return sorted((int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n))),
                  reverse=True)


def newest_whole_step(directory: str, items: tuple[str, ...],
                      step: int | None = None) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose `items` are intact or None, [(newer step, its problem)]).

    With `step`, only that step is considered (a step directory that does not exist is a problem).
    """
    candidates = [step] if step is not None else steps_in(directory)
    skipped = []
    for s in candidates:
        step_dir = os.path.join(directory, str(s))
        why = problem(step_dir, items) if os.path.isdir(step_dir) else "no such step directory"
        if why is None:
            return s, skipped
        skipped.append((s, why))
    return None, skipped
