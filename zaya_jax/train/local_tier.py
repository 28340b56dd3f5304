"""The local checkpoint tier: every process's own shards, and a copy of its neighbour's, on node-local disk.

  checkpoint.local_dir=DIR  checkpoint.local_every=K  checkpoint.local_max_to_keep=2

Every K steps each process writes, without waiting for any other process's write:
  DIR/process_<i>/own/<step>/   the TrainState's arrays as an Orbax item of which this process writes
                                the shards it holds (as Orbax's emergency managers write their local
                                tier: _orbax_local), its data iterator's state and the run's config
                                (as a persistent step's)
  DIR/process_<i>/peer/<step>/  the same for process (i+1) % n: each process packs its distinct shards,
                                their layout and its data state into one byte buffer and hands it to
                                the process before it (_passed_on: a device-to-device collective
                                permute of a [processes, bytes] array, one row per process on its
                                first device: NCCL on GPUs, gloo on CPU); the receiving process
                                saves its row of that array through the same Orbax handler
  DIR/process_<i>/run.json      the run this tier belongs to (WORKDIR/run_id): a tier of another run
                                is refused before training starts, never restored
With one process per node (the SLURM scripts) the neighbour is on another node, so any one lost
node's state survives on the node before it. Each step directory is written like a persistent one:
Orbax's asynchronous save of the item `state` into `<step>.zaya-tmp` (the loop waits for the
device-to-host copies only), then, in a writer thread, the data state and `data/about.json` (the
step, the job's shape, the shards' layout) beside it, integrity.write_manifest (size and crc32 of
every file, Orbax's included), and one rename to `<step>`. A process killed mid-write leaves a
`.zaya-tmp` directory, removed at the next start.

Restore (`agreed_step`, then `restore`; every process calls both): each process lists the steps of
its own and peer copies that pass their manifests (a damaged copy is named and skipped) and that a
job of this shape wrote (same process count and mesh); the processes exchange the lists
(distributed.gather_ints) and take the newest step newer than the persistent tier's for which
every process p has its own copy or process p-1 holds p's as its peer copy. A process without
its own copy (a replaced node, an emptied disk) gets its shards back from the process before it,
through the same hand-off the other way (the others read their own copy through Orbax, each process
its own shards only); where some process's shards of the step were held once
(own or peer copy missing), the trainer then saves the restored step again (own and peer copies,
waiting for them), so every shard is held twice before training goes on. Before it, the config
saved with the step must be one this config resumes (start_checks.check_resumable, as for a persistent step), and after it, the data
iterator state each process restores one its iterator continues (state_problem): otherwise every
process raises a ConfigError naming the step's directory, and nothing is deleted. Nothing usable (another process count or mesh, every
copy of some process lost): the persistent tier, reshaped as before.

Why not Orbax's emergency managers themselves (orbax.checkpoint.experimental.emergency 0.12): they
need a mesh with at least two data-parallel replicas along a replica axis (multi-slice TPU: the
local tier of a slice is restored by broadcasting from a slice that still has it) or an external
replicator service (multi_tier_checkpointing) or a peer-to-peer file service (p2p); this trainer
shards its state over fsdp/expert across processes, so one process's shards may exist nowhere else
unless it copies them out, and it also needs the data iterator's state and the manifest checks.
So the tier is built on the primitives their local tier uses (the handler and its per-process
options), with the peer copy, the agreement and the manifest around them.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import uuid
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from zaya_jax.errors import UserError
from zaya_jax.parallel import distributed
from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.sealing import write_files

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


def _distinct_shards(leaf: jax.Array) -> dict[str, jax.Array]:
    """{index key: single-device array} of this process's distinct shards of `leaf` (a replica once)."""
    distinct = {}
    for shard in leaf.addressable_shards:
        distinct.setdefault(_index_key(shard.index, leaf.shape), shard.data)
    return distinct


def _layout(leaves: list[jax.Array]) -> list:
    """[[shape, dtype, [index keys of this process's distinct shards]] per leaf]."""
    return [[list(leaf.shape), str(leaf.dtype), list(_distinct_shards(leaf))] for leaf in leaves]


def _host_shards(leaves: list[jax.Array]) -> dict[str, np.ndarray]:
    """{"l<n>.s<k>": numpy shard} of this process's distinct shards of `leaves`, in _layout's order
    (blocks for the device-to-host copies)."""
    for leaf in leaves:
        leaf.copy_to_host_async()
    return {f"l{n}.s{k}": np.asarray(data) for n, leaf in enumerate(leaves)
            for k, data in enumerate(_distinct_shards(leaf).values())}


def _check_layout(leaves: list, layout: list, where: str) -> None:
    """Raises UserError naming `where` unless `layout` lists arrays of the shapes and dtypes of `leaves`."""
    if len(leaves) != len(layout):
        raise UserError(f"{where} holds {len(layout)} arrays, this run's state has {len(leaves)}")
    for n, (leaf, (shape, dtype, _)) in enumerate(zip(leaves, layout)):
        if tuple(shape) != leaf.shape or dtype != str(leaf.dtype):
            raise UserError(f"{where}: array {n} is {dtype}{shape}, this run's is {leaf.dtype}{list(leaf.shape)}")


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


def _rows_sharding() -> jax.sharding.NamedSharding:
    """A [processes, bytes] array's rows, one per process on its first device."""
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
              for p in range(jax.process_count())]
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(firsts), ("process",)),
                                      jax.sharding.PartitionSpec("process"))


def _passed_on(payload: np.ndarray, shift: int) -> tuple[jax.Array, int]:
    """Every process's `payload` (uint8) delivered to process (i + shift) % n: (the [processes, bytes]
    array whose row on this process holds what it got, the length of that; _row reads it).

    A device-to-device copy (a collective permute of a [processes, bytes] array, one row per process
    on its first device: NCCL on GPUs, gloo on CPU); every process calls it at the same point.
    """
    index, count = jax.process_index(), jax.process_count()
    sizes = distributed.gather_ints([payload.size >> 20, payload.size & 0xFFFFF])  # MiB, bytes: int32-safe
    lengths = [int(mib) << 20 | int(rest) for mib, rest in sizes]
    width = max(max(lengths), 1)
    sharding = _rows_sharding()
    row = np.zeros((1, width), np.uint8)
    row[0, :payload.size] = payload
    with jax.set_mesh(None):  # the caller's mesh context names its own devices; this mesh has one per process
        rows = jax.make_array_from_process_local_data(sharding, row, (count, width))
        moved = jax.jit(lambda x: jnp.roll(x, shift, axis=0), out_shardings=sharding)(rows)
    return moved, lengths[(index - shift) % count]


def _row(rows: jax.Array, length: int) -> np.ndarray:
    """This process's row of a [processes, bytes] array (_passed_on's), its first `length` bytes."""
    return np.asarray(rows.addressable_shards[0].data)[0][:length]


class _WithoutPerProcessNotice(logging.Filter):
    """Orbax warns at every save with primary_host=None that it does not log the global object size
    (as no process sees the whole); that is this tier's design, so the notice is dropped."""

    def filter(self, record):
        return not record.getMessage().startswith("Global object size logging disabled")


absl_logging.get_absl_logger().addFilter(_WithoutPerProcessNotice())


def _orbax_local(role: str, asynchronous: bool):
    """An Orbax checkpointer of this process alone, as Orbax's emergency managers build their local
    tier's: PyTreeCheckpointHandler (OCDBT, zarr3) with ArrayHandler(primary_host=None,
    replica_id=None): every process writes (and reads) the shards of the global arrays it holds, in
    its own directory; MultiprocessingOptions naming this process only, so no barrier waits for
    another process. `role` keeps the barrier names of the checkpointers of one process apart."""
    index = jax.process_index()
    options = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={index},
                                                 barrier_sync_key_prefix=f"zaya-local-{role}-{index}")
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=options,
                                          type_handler_registry=registry)
    if not asynchronous:
        return ocp.Checkpointer(handler, multiprocessing_options=options)
    # Directories made before save() returns: Orbax's asynchronous creation signals its completion
    # under a key of the job-wide operation counter, which saves of one process alone would share.
    return ocp.AsyncCheckpointer(handler, multiprocessing_options=options,
                                 async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))


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
        self._saving = {self.own: _orbax_local("own", True), self.peer: _orbax_local("peer", True)}  # per directory
        self._reader = _orbax_local("read", False)
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
        leaves = jax.tree.leaves(state)
        layout = _layout(leaves)
        own = {"data/state.json": json.dumps(data_state).encode()}
        self._start(self.own, step, leaves, {"process": self.index, "layout": layout}, own, config)
        if self.count == 1:
            return
        rows, length = _passed_on(_pack({"layout": layout, "data": data_state}, _host_shards(leaves)), -1)
        about = {"process": (self.index + 1) % self.count, "packed": [int(rows.shape[1]), length]}
        self._start(self.peer, step, [rows], about, {}, config)

    def _start(self, directory: str, step: int, arrays: list[jax.Array], about: dict, files: dict[str, bytes],
               config: dict) -> None:
        """Starts saving `arrays` as the Orbax item `state` of `<step>.zaya-tmp` in `directory` (blocks
        for their device-to-host copies); the writer thread adds `files`, data/about.json (`about` and
        the job's shape), data/config.json and the manifest, then renames it to `<step>`."""
        tmp = os.path.join(directory, f"{step}{TMP}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        saving = self._saving[directory]
        saving.save(os.path.join(tmp, "state"), args=ocp.args.PyTreeSave(arrays))
        about = {"step": step, **about, "processes": self.count, "mesh": dict(self.mesh.shape), "run": self.run,
                 "devices": self._devices()}
        files = {**files, "data/about.json": json.dumps(about).encode(), "data/config.json": json.dumps(config).encode()}
        self._pending.append(self._writer.submit(self._finish, saving, directory, step, files))

    def _finish(self, saving, directory: str, step: int, files: dict[str, bytes]) -> None:
        """In the writer thread: once Orbax has written the step's `state`, seals it and renames it into
        place; then retention."""
        saving.wait_until_finished()
        tmp, final = os.path.join(directory, f"{step}{TMP}"), os.path.join(directory, str(step))
        write_files(tmp, files)
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
            for checkpointer in (*self._saving.values(), self._reader):
                checkpointer.close()

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
                elif about.get("devices") != self._devices():
                    why = (f"saved with the mesh's devices placed as {about.get('devices')} (ids in mesh order); this "
                           f"job's are {self._devices()}, so this process holds other shards now")
            if why is None:
                out.append(step)
            else:
                log(f"process {self.index}: local step {step} in {step_dir} skipped ({why})")
        return out[:MAX_LISTED]

    def _devices(self) -> list[int]:
        """The mesh's device ids in mesh order: with the job's shape, what fixes which shards each process holds."""
        return [int(d.id) for d in self.mesh.devices.flat]

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

    def _peer_copy(self, step: int) -> np.ndarray:
        """The packed bytes (_pack's) of the neighbour's shards this process holds for `step`."""
        step_dir = os.path.join(self.peer, str(step))
        width, length = self._about(step_dir)["packed"]
        target = jax.ShapeDtypeStruct((self.count, width), np.uint8, sharding=_rows_sharding())
        return _row(self._restored(os.path.join(step_dir, "state"), [target])[0], length)

    def _restored(self, path: str, leaves: list) -> list[jax.Array]:
        """The arrays of the Orbax item `path`, on the shardings of `leaves` (ShapeDtypeStructs); this
        process reads its own shards only."""
        return self._reader.restore(path, args=ocp.args.PyTreeRestore(
            item=leaves, restore_args=[ocp.ArrayRestoreArgs(sharding=leaf.sharding) for leaf in leaves]))

    @staticmethod
    def _arrays(target, layout: list, blobs: dict[str, np.ndarray], where: str):
        """The arrays of `target` (ShapeDtypeStructs with shardings) from this process's shards `blobs`."""
        leaves, tree = jax.tree.flatten(target)
        _check_layout(leaves, layout, where)
        out = []
        for n, (leaf, (_, _, keys)) in enumerate(zip(leaves, layout)):
            names = {key: f"l{n}.s{k}" for k, key in enumerate(keys)}

            def read(index, shape=leaf.shape, dtype=leaf.dtype, names=names):
                return blobs[names[_index_key(index, shape)]].view(dtype).reshape(_shape_of(index, shape))
            out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
        return jax.tree.unflatten(tree, out)

    def restore(self, step: int, from_peer: list[int], target) -> tuple[object, dict]:
        """(state, this process's data iterator state) of `step` (agreed_step's), every process together.
        `target`: a TrainState of ShapeDtypeStructs with this run's shardings. A process in `from_peer`
        gets its shards from the previous process's peer copy (_passed_on); the others read their own
        copy through Orbax."""
        if from_peer:
            neighbour = (self.index + 1) % self.count
            payload = self._peer_copy(step) if neighbour in from_peer else np.zeros(0, np.uint8)
            rows, length = _passed_on(payload, 1)
            if self.index in from_peer:
                header, blobs = _unpack(_row(rows, length))
                where = f"process {(self.index - 1) % self.count}'s peer copy of step {step}"
                return self._arrays(target, header["layout"], blobs, where), header["data"]
        step_dir = os.path.join(self.own, str(step))
        leaves, tree = jax.tree.flatten(target)
        _check_layout(leaves, self._about(step_dir)["layout"], step_dir)
        with open(os.path.join(step_dir, "data", "state.json")) as f:
            data_state = json.load(f)
        return jax.tree.unflatten(tree, self._restored(os.path.join(step_dir, "state"), leaves)), data_state


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
