"""The integrity manifest written inside Orbax's commit: no instant at which a committed step lacks it.

Orbax saves a step into `<step>.orbax-checkpoint-tmp-*` and commits it by renaming that directory
to `<step>` (process 0, once every process has written its share and every item is final:
`AtomicRenameTemporaryPath.finalize`). `Sealer.path_class` is that temporary path with one step
added in front of the rename: `zaya_manifest.json` (integrity.py) is written into the temporary
directory. So at every instant of a save:
  - before the rename, the step exists only as a temporary directory, which is never restored (the
    next start removes it): a kill there loses only the save in progress;
  - from the rename on, the step directory holds every item and its manifest: a kill there loses
    nothing, and the next start resumes from that step.
The two files Orbax writes while committing, after the manifest (the commit timestamp in
`_CHECKPOINT_METADATA`, `commit_success.txt`), are not listed in it (integrity.COMMIT_RECORDS).
Files that are no Orbax item (`files` of `starting`: the run's tokenizer, carried_tokenizer.py)
are written into the temporary directory just before the manifest, so they are listed in it and
committed by the same rename: a step holds them whole or does not exist.

Checksumming is shared by the processes of a job, each reading about 1/P of the bytes: process 0
(in Orbax's commit thread) posts the temporary directory and its file sizes on jax.distributed's
key-value store; on every other process a thread started with the save waits for that post,
checksums its share and posts it back; process 0 combines the shares and writes the manifest. A
save that fails before its commit ends those threads (they stop waiting once Orbax's save on
their process is over).

  sealer = Sealer(directory, kind)                # kind: "training" or "model" (integrity.ITEMS)
  ocp.CheckpointManagerOptions(temporary_path_class=sealer.path_class, ...)
  sealer.starting(step, in_progress, files)       # every process, before each save of `step`;
                                                  # files: {relative path: bytes} to add (process 0's)
  sealer.errors()                                 # the checksum threads' errors so far (and wait=True)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from typing import Callable

import jax
import orbax.checkpoint as ocp

from zaya_jax.parallel import distributed
from zaya_jax.checkpoints import integrity

_POLL_S = 1  # how often a waiting process checks that its own save is still under way


def write_files(step_dir: str, files: dict[str, bytes]) -> None:
    """Writes each of `files` ({path relative to `step_dir`: contents}) to disk (fsynced)."""
    for relative, contents in files.items():
        path = os.path.join(step_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(contents)
            f.flush()
            os.fsync(f.fileno())


class Sealer:
    """Writes the manifest of every step saved into `directory` before Orbax commits the step."""

    def __init__(self, directory: str, kind: str):
        self.directory, self.kind = os.path.abspath(directory), kind
        self._saves = 0  # saves started: the same count on every process, so a board name per save
        self._boards: dict[int, str] = {}  # step -> the board of its save, until process 0 seals it
        self._files: dict[int, dict[str, bytes]] = {}  # step -> the files to add to it, until it is sealed
        self._helpers = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")
        self._shares: list[concurrent.futures.Future] = []  # this process's checksumming, per save
        self.path_class = self._make_path_class()

    def _make_path_class(self) -> type:
        sealer = self

        class SealedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
            """Orbax's atomic rename, with the manifest written into the temporary step directory
            first (the items' own temporary directories, which use this class too, are left alone)."""

            async def finalize(self):
                final = self.get_final()
                if os.path.dirname(os.fspath(final)) == sealer.directory and final.name.isdigit():
                    await asyncio.to_thread(sealer.seal, os.fspath(self.get()), int(final.name))
                return await super().finalize()

        return SealedRename

    def starting(self, step: int, in_progress: Callable[[], bool], files: dict[str, bytes] | None = None) -> None:
        """Every process, before Orbax starts saving `step`; `in_progress()`: whether that save is
        still under way on this process (the checksum thread stops waiting once it is not); `files`
        ({path relative to the step directory: contents}): what process 0 writes into the step
        beside Orbax's items before sealing it."""
        self._saves += 1
        board = f"zaya_manifest_{self._saves}"
        self._boards[step] = board
        self._files[step] = files or {}
        if jax.process_index() != 0:
            self._shares.append(self._helpers.submit(self._post_share, board, in_progress))

    def seal(self, step_dir: str, step: int) -> None:
        """Process 0, in Orbax's commit thread: writes the manifest of `step_dir` (the temporary directory
        of `step`, every item final) from every process's checksums."""
        board, count = self._boards.pop(step), jax.process_count()
        write_files(step_dir, self._files.pop(step))
        if count == 1:
            integrity.write_manifest(step_dir, self.kind)
            return
        sizes = integrity.file_sizes(step_dir)
        distributed.post(f"{board}/files", json.dumps({"dir": step_dir, "sizes": sizes}))
        parts = [integrity.checksums(step_dir, sizes, 0, count)]
        timeout = distributed.barrier_timeout_s()
        parts += [json.loads(distributed.wait_posted(f"{board}/{k}", timeout)) for k in range(1, count)]
        distributed.unpost(f"{board}/")
        integrity.write_manifest(step_dir, self.kind, parts)

    def _post_share(self, board: str, in_progress: Callable[[], bool]) -> None:
        """A process other than 0: once process 0 posts the files of the save on `board`, checksums this
        process's share and posts it. Returns without posting when the save ends first (it failed)."""
        while True:
            try:
                files = json.loads(distributed.wait_posted(f"{board}/files", _POLL_S))
                break
            except Exception:  # pylint: disable=broad-except  # jax's deadline error: not posted yet
                if not in_progress():  # a commit waits for this share, so the save failed before it
                    return
        shares = integrity.checksums(files["dir"], files["sizes"], jax.process_index(), jax.process_count())
        distributed.post(f"{board}/{jax.process_index()}", json.dumps(shares))

    def errors(self, wait: bool = False) -> list[BaseException]:
        """The errors of this process's finished checksum threads (all of them, waiting, with `wait`)."""
        if wait:
            concurrent.futures.wait(self._shares)
        done, pending = [], []
        for share in self._shares:  # one done() per future: one finishing meanwhile is not lost
            (done if share.done() else pending).append(share)
        self._shares = pending
        errors = (share.exception() for share in done)
        return [e for e in errors if e is not None]

    def close(self) -> None:
        self._helpers.shutdown(wait=False, cancel_futures=True)
