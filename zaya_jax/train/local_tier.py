"""The local checkpoint tier: every process's own shards, and a copy of its neighbour's, on node-local disk.

  checkpoint.local_dir=DIR  checkpoint.local_every=K  checkpoint.local_max_to_keep=2

Every K steps each process writes, without waiting for any other process's write:
  DIR/process_<i>/own/<step>/   its addressable shards of the whole TrainState (each distinct shard
                                once: arrays replicated over its devices are written once), its
                                data iterator's state and the run's config (as a persistent step's)
  DIR/process_<i>/peer/<step>/  the same for process (i+1) % n: each process packs its shards, their
                                layout and its data state into one byte buffer and hands it to the
                                process before it (_passed_on: a device-to-device collective permute
                                of one row per process, NCCL on GPUs, gloo on CPU)
  DIR/process_<i>/run.json      the run this tier belongs to (WORKDIR/run_id): a tier of another run
                                is refused before training starts, never restored
With one process per node (the SLURM scripts) the neighbour is on another node, so any one lost
node's state survives on the node before it. Each step directory is written like a persistent one:
the shards as raw files `state/l<leaf>.s<shard>` (their shapes, dtypes and places in `data/about.json`)
into `<step>.zaya-tmp`, the data state beside them, then integrity.write_manifest (size and crc32
of every file), then one rename to `<step>`. A process killed mid-write leaves a `.zaya-tmp`
directory, removed at the next start.

Restore (`agreed_step`, then `restore`; every process calls both): each process lists the steps of
its own and peer copies that pass their manifests (a damaged copy is named and skipped) and that a
job of this shape wrote (same process count and mesh); the processes exchange the lists
(distributed.gather_ints) and take the newest step newer than the persistent tier's for which
every process p has its own copy or process p-1 holds p's as its peer copy. A process without
its own copy (a replaced node, an emptied disk) gets its files back from the process before it,
through the same hand-off the other way; where some process's shards of the step were held once
(own or peer copy missing), the trainer then saves the restored step again (own and peer copies,
waiting for them), so every shard is held twice before training goes on. Before it, the config
saved with the step must be one this config resumes (start_checks.check_resumable, as for a persistent step), and after it, the data
iterator state each process restores one its iterator continues (state_problem): otherwise every
process raises a ConfigError naming the step's directory, and nothing is deleted. Nothing usable (another process count or mesh, every
copy of some process lost): the persistent tier, reshaped as before.

Why not Orbax's emergency managers (orbax.checkpoint.experimental.emergency 0.12): they need a
mesh with at least two data-parallel replicas along a replica axis (multi-slice TPU: the local
tier of a slice is restored by broadcasting from a slice that still has it) or an external
replicator service (multi_tier_checkpointing) or a peer-to-peer file service (p2p); this trainer
shards its state over fsdp/expert across processes, so one process's shards may exist nowhere else
unless it writes them out, and it also needs the data iterator's state and the manifest checks.
Nor Orbax's handlers for the files: in 0.12.8 its NumpyHandler writes from process 0 only (a fixed
`process_index() == 0`), and its ArrayHandler's per-process writes (primary_host=None) leave one
OCDBT database per process that its managers merge across processes; a process here must write
and read its directory alone, whatever the others do. The files are plain bytes, checked by the
same manifest as a persistent step.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import uuid
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.errors import UserError
from zaya_jax.parallel import distributed
from zaya_jax.train import integrity
from zaya_jax.train.sealing import write_files

class Agreed(NamedTuple):
    """A local step every process can restore."""
    step: int
    from_peer: list[int]  # processes restored from their neighbour's peer copy
    held_once: list[int]  # processes whose shards of the step are in one copy only (own or peer)


TMP = ".zaya-tmp"
RUN_ID = "run_id"  # WORKDIR/run_id: the identity of a run, written at its first start
MAX_LISTED = 8     # steps per copy exchanged at restore (more than local_max_to_keep ever keeps)


def process_dir(local_dir: str, index: int) -> str:
    return os.path.join(os.path.abspath(local_dir), f"process_{index}")


def run_id(workdir: str) -> str:
    """This run's identity (WORKDIR/run_id, written by process 0 at the first start), on every process."""
    path = os.path.join(workdir, RUN_ID)
    if jax.process_index() == 0:
        if not os.path.isfile(path):
            write_files(workdir, {RUN_ID: uuid.uuid4().hex.encode()})
        with open(path) as f:
            distributed.post("zaya_run_id", f.read().strip())
    return distributed.wait_posted("zaya_run_id", distributed.barrier_timeout_s())


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its array, e.g. '0:4,0:64' ('' for a scalar)."""
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape))


def _host_shards(state) -> tuple[dict, list]:
    """({"l<n>.s<k>": numpy shard}, layout [[shape, dtype, [index keys]] per leaf]) of this
    process's distinct shards of every leaf of `state` (blocks for the device-to-host copies)."""
    leaves = jax.tree.leaves(state)
    for leaf in leaves:
        leaf.copy_to_host_async()
    shards, layout = {}, []
    for n, leaf in enumerate(leaves):
        distinct = {}
        for shard in leaf.addressable_shards:
            distinct.setdefault(_index_key(shard.index, leaf.shape), shard.data)
        shards.update({f"l{n}.s{k}": np.asarray(data) for k, data in enumerate(distinct.values())})
        layout.append([list(leaf.shape), str(leaf.dtype), list(distinct)])
    return shards, layout


def _pack(header: dict, blobs: dict[str, np.ndarray]) -> np.ndarray:
    """One uint8 buffer: 8 bytes of header length, the JSON header (with the blobs' names and sizes), the blobs."""
    arrays = [np.ascontiguousarray(b).reshape(-1).view(np.uint8) for b in blobs.values()]
    head = json.dumps({**header, "blobs": [[name, int(a.size)] for name, a in zip(blobs, arrays)]}).encode()
    return np.concatenate([np.frombuffer(np.uint64(len(head)).tobytes() + head, np.uint8), *arrays])


def _unpack(buffer: np.ndarray) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, {name: uint8 blob}) of a _pack buffer."""
    size = int(buffer[:8].view(np.uint64)[0])
    header = json.loads(buffer[8:8 + size].tobytes())
    blobs, offset = {}, 8 + size
    for name, nbytes in header.pop("blobs"):
        blobs[name] = buffer[offset:offset + nbytes]
        offset += nbytes
    return header, blobs


def _passed_on(payload: np.ndarray, shift: int) -> np.ndarray:
    """Every process's `payload` (uint8) delivered to process (i + shift) % n; returns what this one got.

    A device-to-device copy (a collective permute of a [processes, bytes] array, one row per process
    on its first device: NCCL on GPUs, gloo on CPU); every process calls it at the same point.
    """
    index, count = jax.process_index(), jax.process_count()
    sizes = distributed.gather_ints([payload.size >> 20, payload.size & 0xFFFFF])  # MiB, bytes: int32-safe
    lengths = [int(mib) << 20 | int(rest) for mib, rest in sizes]
    width = max(max(lengths), 1)
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(firsts), ("process",)),
                                          jax.sharding.PartitionSpec("process"))
    row = np.zeros((1, width), np.uint8)
    row[0, :payload.size] = payload
    with jax.set_mesh(None):  # the caller's mesh context names its own devices; this mesh has one per process
        rows = jax.make_array_from_process_local_data(sharding, row, (count, width))
        moved = jax.jit(lambda x: jnp.roll(x, shift, axis=0), out_shardings=sharding)(rows)
    received = np.asarray(moved.addressable_shards[0].data)[0]
    return received[:lengths[(index - shift) % count]]


class LocalTier:
    """Writes and restores the local tier of this process (see the module docstring)."""

    def __init__(self, local_dir: str, keep: int, mesh: jax.sharding.Mesh, run: str):
        """Raises UserError on every process (before training) when some process's directory is not
        writable or holds the tier of another run."""
        self.index, self.count = jax.process_index(), jax.process_count()
        self.home = process_dir(local_dir, self.index)
        self.own, self.peer = os.path.join(self.home, "own"), os.path.join(self.home, "peer")
        self.keep, self.mesh, self.run = keep, mesh, run
        self._check_on_every_process(self._problem())
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-tier")
        self._pending: list[concurrent.futures.Future] = []

    def _problem(self) -> str | None:
        """Why this process cannot keep its tier in its directory (one line), else None; marks it as this run's."""
        try:
            for directory in (self.own, self.peer):
                os.makedirs(directory, exist_ok=True)
                for name in os.listdir(directory):
                    if name.endswith(TMP):  # a write a kill cut short
                        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            marker = os.path.join(self.home, "run.json")
            if os.path.isfile(marker):
                with open(marker) as f:
                    other = json.load(f).get("run")
                if other != self.run and (integrity.steps_in(self.own) or integrity.steps_in(self.peer)):
                    return (f"checkpoint.local_dir: {self.home} holds the local tier of another run (run id {other}; "
                            f"this run's, in WORKDIR/{RUN_ID}, is {self.run}): empty that directory (nothing of this "
                            "run is in it) or choose another --config.checkpoint.local_dir")
            write_files(self.home, {"run.json": json.dumps({"run": self.run}).encode()})
        except OSError as e:
            return (f"checkpoint.local_dir: {e.filename or self.home} is not writable: {e.strerror} (errno {e.errno}); "
                    "fix its permissions or choose another --config.checkpoint.local_dir")
        return None

    def _check_on_every_process(self, problem: str | None) -> None:
        raise_on_every_process(problem, "checkpoint.local_dir: process {} cannot keep its local tier (see its message)")

    # -- saving ------------------------------------------------------------------------------------
    def save(self, state, data_state: dict, config: dict) -> None:
        """Every process at the same step: starts writing `state`'s shards (own and the neighbour's),
        the data iterator state and `config` (checkpoint.config_json's record of the run, the same on
        every process). Blocks for the device-to-host copies and the previous local save."""
        self.wait()
        step = int(jax.device_get(state.step))
        own, layout = _host_shards(state)
        self._pending.append(self._writer.submit(self._write, self.own, step, own, layout, self.index, data_state,
                                                 config))
        if self.count == 1:
            return
        received = _passed_on(_pack({"layout": layout, "data": data_state}, own), -1)  # the neighbour's
        header, blobs = _unpack(received)
        neighbour = (self.index + 1) % self.count
        self._pending.append(self._writer.submit(self._write, self.peer, step, blobs, header["layout"], neighbour,
                                                 header["data"], config))

    def _write(self, directory: str, step: int, shards: dict, layout: list, owner: int, data_state: dict,
               config: dict) -> None:
        """In the writer thread: one step directory, sealed and renamed into place; then retention."""
        tmp, final = os.path.join(directory, f"{step}{TMP}"), os.path.join(directory, str(step))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "state"))
        for name, shard in shards.items():
            with open(os.path.join(tmp, "state", name), "wb") as f:
                f.write(np.ascontiguousarray(shard).reshape(-1).view(np.uint8))
                f.flush()
                os.fsync(f.fileno())
        about = {"step": step, "process": owner, "processes": self.count, "mesh": dict(self.mesh.shape),
                 "run": self.run, "layout": layout}
        write_files(tmp, {"data/state.json": json.dumps(data_state).encode(),
                          "data/about.json": json.dumps(about).encode(), "data/config.json": json.dumps(config).encode()})
        integrity.write_manifest(tmp, "local")
        if os.path.isdir(final):  # a step saved again (after a restore from an older one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in integrity.steps_in(directory)[self.keep:]:
            shutil.rmtree(os.path.join(directory, str(old)), ignore_errors=True)

    def poll(self) -> Exception | None:
        """At a step boundary: the error of a finished local write, if one failed."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        errors = [f.exception() for f in done if f.exception() is not None]
        return errors[0] if errors else None

    def wait(self) -> None:
        """Blocks until every local write started has finished (raises the first failure)."""
        concurrent.futures.wait(self._pending)
        error = self.poll()
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    # -- restoring ---------------------------------------------------------------------------------
    def _whole(self, directory: str, log) -> list[int]:
        """Steps of `directory` that pass their manifest and were saved by a job of this shape (newest first)."""
        out = []
        for step in integrity.steps_in(directory):
            step_dir = os.path.join(directory, str(step))
            why = integrity.problem(step_dir, integrity.ITEMS["local"])
            if why is None:
                about = self._about(step_dir)
                shape = (about["processes"], about["mesh"], about["run"])
                if shape != (self.count, dict(self.mesh.shape), self.run):
                    why = (f"saved by a job of {about['processes']} process(es) on mesh {about['mesh']}; this job has "
                           f"{self.count} on {dict(self.mesh.shape)}")
            if why is None:
                out.append(step)
            else:
                log(f"process {self.index}: local step {step} in {step_dir} skipped ({why})")
        return out[:MAX_LISTED]

    @staticmethod
    def _about(step_dir: str) -> dict:
        with open(os.path.join(step_dir, "data", "about.json")) as f:
            return json.load(f)

    def agreed_step(self, newer_than: int, log) -> Agreed | None:
        """The newest local step newer than `newer_than` that every process can restore, the same on
        every process; None if none."""
        self.wait()
        own, peer = self._whole(self.own, log), self._whole(self.peer, log)
        pad = lambda steps: steps + [-1] * (MAX_LISTED - len(steps))  # noqa: E731
        table = distributed.gather_ints(pad(own) + pad(peer))
        owns = [set(row[:MAX_LISTED]) - {-1} for row in table]
        peers = [set(row[MAX_LISTED:]) - {-1} for row in table]
        for step in sorted(set().union(*owns), reverse=True):
            if step <= newer_than:
                break
            if all(step in owns[p] or step in peers[(p - 1) % self.count] for p in range(self.count)):
                return Agreed(int(step), [p for p in range(self.count) if step not in owns[p]],
                              [p for p in range(self.count) if step not in owns[p] or
                               (self.count > 1 and step not in peers[(p - 1) % self.count])])
        return None

    def saved_config(self, step: int) -> tuple[str, dict] | None:
        """(the directory holding it, the run config saved with `step`) from this process's own copy of
        the step, else its peer copy (the same run's), or None when it holds neither."""
        for directory in (self.own, self.peer):
            path = os.path.join(directory, str(step), "data", "config.json")
            if os.path.isfile(path):
                with open(path) as f:
                    return directory, json.load(f)
        return None

    def _files(self, directory: str, step: int) -> tuple[dict, dict[str, np.ndarray]]:
        """({"layout", "data"}, {shard file name: uint8 contents}) of a saved step."""
        step_dir = os.path.join(directory, str(step))
        with open(os.path.join(step_dir, "data", "state.json")) as f:
            header = {"layout": self._about(step_dir)["layout"], "data": json.load(f)}
        names = sorted(os.listdir(os.path.join(step_dir, "state")))
        return header, {name: np.fromfile(os.path.join(step_dir, "state", name), np.uint8) for name in names}

    @staticmethod
    def _arrays(target, layout: list, blobs: dict[str, np.ndarray], where: str):
        """The arrays of `target` (ShapeDtypeStructs with shardings) from this process's shards `blobs`."""
        leaves, tree = jax.tree.flatten(target)
        if len(leaves) != len(layout):
            raise UserError(f"{where} holds {len(layout)} arrays, this run's state has {len(leaves)}")
        out = []
        for n, (leaf, (shape, dtype, keys)) in enumerate(zip(leaves, layout)):
            if tuple(shape) != leaf.shape or dtype != str(leaf.dtype):
                raise UserError(f"{where}: array {n} is {dtype}{shape}, this run's is {leaf.dtype}{list(leaf.shape)}")
            names = {key: f"l{n}.s{k}" for k, key in enumerate(keys)}

            def read(index, shape=leaf.shape, dtype=leaf.dtype, names=names):
                return blobs[names[_index_key(index, shape)]].view(dtype).reshape(_shape_of(index, shape))
            out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
        return jax.tree.unflatten(tree, out)

    def restore(self, step: int, from_peer: list[int], target) -> tuple[object, dict]:
        """(state, this process's data iterator state) of `step` (agreed_step's), every process together.
        `target`: a TrainState of ShapeDtypeStructs with this run's shardings. A process in `from_peer`
        gets its files from the previous process's peer copy (_passed_on)."""
        if from_peer:
            neighbour = (self.index + 1) % self.count
            payload = (_pack(*self._files(self.peer, step)) if neighbour in from_peer else np.zeros(0, np.uint8))
            received = _passed_on(payload, 1)
            if self.index in from_peer:
                header, blobs = _unpack(received)
                where = f"process {(self.index - 1) % self.count}'s peer copy of step {step}"
                return self._arrays(target, header["layout"], blobs, where), header["data"]
        header, blobs = self._files(self.own, step)
        return self._arrays(target, header["layout"], blobs, os.path.join(self.own, str(step))), header["data"]


def _shape_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(dim))) for s, dim in zip(index, shape))


def raise_on_every_process(problem: str | None, elsewhere: str) -> None:
    """Every process together: raises UserError(`problem`) where it is not None, and on every other
    process when some process has one (`elsewhere` with that process's index for {})."""
    failing = distributed.gather_ints([int(problem is not None)])[:, 0]
    if problem:
        raise UserError(problem)
    if failing.any():
        raise UserError(elsewhere.format(int(np.argmax(failing))))
