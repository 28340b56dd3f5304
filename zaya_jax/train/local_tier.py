"""The local checkpoint tier: every process's own shards, and a copy of its neighbour's, on node-local disk.

  checkpoint.local_dir=DIR  checkpoint.local_every=K  checkpoint.local_max_to_keep=2

Every K steps each process writes, without waiting for any other process's write:
  DIR/process_<i>/own/<step>/   its addressable shards of the whole TrainState (each distinct shard
                                once: arrays replicated over its devices are written once) and its
                                data iterator's state
  DIR/process_<i>/peer/<step>/  the same for process (i+1) % n: the neighbour's shards reach process
                                i through one device-to-device copy per save (the state resharded
                                onto the mesh with every process's devices replaced by those of the
                                process before it: a collective permute, NCCL on GPUs, gloo on CPU),
                                its data iterator state through jax.distributed's key-value store
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
its own copy (a replaced node, an emptied disk) gets its shards back through the reverse copy and
its data state from the key-value store. Nothing usable (another process count or mesh, every
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

import jax
import numpy as np

from zaya_jax.errors import UserError
from zaya_jax.parallel import distributed
from zaya_jax.train import integrity
from zaya_jax.train.sealing import write_files

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


def _rolled(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` with each process's devices replaced by those of the process before it (same local
    position): an array put on it lands on process p-1 where it sat on process p."""
    by_process: dict[int, list] = {}
    for d in sorted(mesh.devices.flat, key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    count = len(by_process)
    devices = np.vectorize(lambda d: by_process[(d.process_index - 1) % count][by_process[d.process_index].index(d)],
                           otypes=[object])(mesh.devices)
    return jax.sharding.Mesh(devices, mesh.axis_names)


def _on(mesh: jax.sharding.Mesh, tree):
    """`tree`'s shardings (NamedShardings) moved onto `mesh`."""
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s.spec), tree)


def _moved(tree, shardings):
    """`tree`'s arrays copied onto `shardings` (the same devices in another order: a collective permute
    between processes). Outside the caller's mesh context: jit refuses a context mesh whose device
    order differs from its arguments', and here the two orders differ by design."""
    with jax.set_mesh(None):
        return jax.tree.map(jax.device_put, tree, shardings)


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
        self._posted: str | None = None  # this process's data state key of the last save (removed at the next)

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
        failing = distributed.gather_ints([int(problem is not None)])[:, 0]
        if problem:
            raise UserError(problem)
        if failing.any():
            raise UserError(f"checkpoint.local_dir: process {int(np.argmax(failing))} cannot keep its local tier "
                            "(see its message)")

    # -- saving ------------------------------------------------------------------------------------
    def save(self, state, data_state: dict) -> None:
        """Every process at the same step: starts writing `state`'s shards (own and the neighbour's) and
        the data iterator state. Blocks for the device-to-host copies and the previous local save."""
        self.wait()
        step = int(jax.device_get(state.step))
        own, layout = _host_shards(state)
        self._pending.append(self._writer.submit(self._write, self.own, step, own, layout, self.index, data_state))
        if self.count == 1:
            return
        rolled = _moved(state, jax.tree.map(lambda a: _on(_rolled(self.mesh), a.sharding), state))
        peer, peer_layout = _host_shards(rolled)
        neighbour = (self.index + 1) % self.count
        if self._posted:
            distributed.unpost(self._posted + "/")
        self._posted = f"zaya_local_data/{step}/{self.index}"
        distributed.post(self._posted, json.dumps(data_state))
        peer_data = json.loads(distributed.wait_posted(f"zaya_local_data/{step}/{neighbour}",
                                                       distributed.barrier_timeout_s()))
        self._pending.append(self._writer.submit(self._write, self.peer, step, peer, peer_layout, neighbour, peer_data))

    def _write(self, directory: str, step: int, shards: dict, layout: list, owner: int, data_state: dict) -> None:
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
                          "data/about.json": json.dumps(about).encode()})
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
                if about["processes"] != self.count or about["mesh"] != dict(self.mesh.shape) or about["run"] != self.run:
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

    def agreed_step(self, newer_than: int, log) -> tuple[int, list[int]] | None:
        """(step, [processes restored from their neighbour's peer copy]) of the newest local step newer
        than `newer_than` that every process can restore, the same on every process; None if none."""
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
                return int(step), [p for p in range(self.count) if step not in owns[p]]
        return None

    def _read(self, directory: str, step: int, target):
        """The arrays of `target` (ShapeDtypeStructs with shardings) from the shards in `directory`/`step`."""
        step_dir = os.path.join(directory, str(step))
        layout = self._about(step_dir)["layout"]
        leaves, tree = jax.tree.flatten(target)
        if len(leaves) != len(layout):
            raise UserError(f"{step_dir} holds {len(layout)} arrays, this run's state has {len(leaves)}")
        out = []
        for n, (leaf, (shape, dtype, keys)) in enumerate(zip(leaves, layout)):
            if tuple(shape) != leaf.shape or dtype != str(leaf.dtype):
                raise UserError(f"{step_dir}: array {n} is {dtype}{shape}, this run's is {leaf.dtype}{list(leaf.shape)}")
            files = {key: os.path.join(step_dir, "state", f"l{n}.s{k}") for k, key in enumerate(keys)}

            def read(index, shape=tuple(shape), dtype=leaf.dtype, files=files):
                return np.fromfile(files[_index_key(index, shape)], dtype=dtype).reshape(_shape_of(index, shape))
            out.append(jax.make_array_from_callback(tuple(shape), leaf.sharding, read))
        return jax.tree.unflatten(tree, out)

    def restore(self, step: int, from_peer: list[int], target) -> tuple[object, dict]:
        """(state, this process's data iterator state) of `step` (agreed_step's), every process together.
        `target`: a TrainState of ShapeDtypeStructs with this run's shardings."""
        if not from_peer:
            with open(os.path.join(self.own, str(step), "data", "state.json")) as f:
                return self._read(self.own, step, target), json.load(f)
        rolled = _rolled(self.mesh)
        rolled_target = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype,
                                                                    sharding=_on(rolled, t.sharding)), target)
        neighbour = (self.index + 1) % self.count
        if neighbour in from_peer:  # this process holds the shards the neighbour lost, and its data state
            peer = self._read(self.peer, step, rolled_target)
            with open(os.path.join(self.peer, str(step), "data", "state.json")) as f:
                distributed.post(f"zaya_local_restore/{step}/{neighbour}", f.read())
        else:
            peer = jax.tree.map(lambda t: jax.make_array_from_callback(
                t.shape, t.sharding, lambda index, t=t: np.zeros(_shape_of(index, t.shape), t.dtype)), rolled_target)
        back = _moved(peer, jax.tree.map(lambda t: t.sharding, target))  # every process
        if self.index in from_peer:
            data = json.loads(distributed.wait_posted(f"zaya_local_restore/{step}/{self.index}",
                                                      distributed.barrier_timeout_s()))
            return back, data
        with open(os.path.join(self.own, str(step), "data", "state.json")) as f:
            return self._read(self.own, step, target), json.load(f)


def _shape_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(dim))) for s, dim in zip(index, shape))
