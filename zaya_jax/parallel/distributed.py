"""Multi-host start-up and global batches.

`initialize()` starts jax.distributed from, in order of precedence:
  explicit arguments / ZAYA_COORDINATOR, ZAYA_NUM_PROCESSES, ZAYA_PROCESS_ID (launch/local.sh);
  SLURM (SLURM_JOB_ID with SLURM_NTASKS > 1: jax's own SLURM cluster detection, with the GPUs each
  task drives named by `slurm_local_device_ids`: all of its node's with one task per node, its own
  with one task per GPU);
  nothing: a single process, jax.distributed is not started.
`global_batch(local, mesh)` assembles the global batch from each process's rows.
`broadcast_int` / `max_over_processes` / `gather_ints`: process 0's value / the largest value /
every process's list, on every process (the trainer's choice of checkpoint, its stop decision, the
local tier's restore agreement).
`barrier(name)`: waits for every process through the coordination service, not a device collective
(see its docstring: why the trainer calls it after each compilation).
`post(key, value)` / `posted(directory)` / `wait_posted(key)` / `unpost(directory)`: a key-value board every process reads
(jax.distributed's store; a dict in a single process), for decisions that must not wait in a
collective (faults.py) and for what background threads exchange (checkpoint manifests).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pallas_kernels._backend import target
from zaya_jax.config import ConfigError
from zaya_jax.parallel.rules import batch_spec

log = logging.getLogger(__name__)
_STARTED = False
_MULTI_PROCESS = False  # initialize() started jax.distributed (explicit or SLURM): this is one of several processes


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def _use_cpu_collectives() -> None:
    """Cross-process collectives on CPU (launch/local.sh) go through gloo; GPUs ignore this."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _keep_python_signal_handlers() -> None:
    """jax's preemption service would take SIGTERM from the trainer's own handler (zaya_jax.train.faults,
    which agrees a stop across processes at every step boundary, SIGINT included); it stays off."""
    jax.config.update("jax_enable_preemption_service", False)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               env: Mapping[str, str] | None = None) -> str:
    """Starts jax.distributed when the job has more than one process; returns how it was configured.

    Must run before anything touches jax devices. Calling it again is a no-op.
    """
    global _STARTED, _MULTI_PROCESS
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("ZAYA_COORDINATOR")
    num_processes = num_processes if num_processes is not None else _int_env(env, "ZAYA_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _int_env(env, "ZAYA_PROCESS_ID")
    explicit = coordinator or num_processes is not None or process_id is not None
    if explicit:  # checked before the no-op below, so a bad environment is named on every call
        missing = [n for n, v in (("coordinator (ZAYA_COORDINATOR)", coordinator),
                                  ("num_processes (ZAYA_NUM_PROCESSES)", num_processes),
                                  ("process_id (ZAYA_PROCESS_ID)", process_id)) if v is None]
        if missing:
            raise ConfigError(f"multi-process start needs all of coordinator, num_processes, process_id; "
                              f"missing {', '.join(missing)}")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"process_id {process_id} must lie in [0, num_processes={num_processes})")
    if _STARTED:
        return "already initialized"
    if explicit:
        _use_cpu_collectives()
        _keep_python_signal_handlers()
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        how = f"explicit: process {process_id} of {num_processes}, coordinator {coordinator}"
    elif env.get("SLURM_JOB_ID") and (_int_env(env, "SLURM_NTASKS") or 1) > 1:
        _keep_python_signal_handlers()
        jax.distributed.initialize(local_device_ids=slurm_local_device_ids(env))
        how = f"SLURM job {env['SLURM_JOB_ID']}: process {jax.process_index()} of {jax.process_count()}"
    else:
        how = "single process"
    _STARTED, _MULTI_PROCESS = True, how != "single process"
    return how


def multi_process() -> bool:
    """Whether initialize() made this process one of a jax.distributed job's (never starts jax)."""
    return _MULTI_PROCESS


def slurm_local_device_ids(env: Mapping[str, str]) -> list[int] | None:
    """The GPUs (node-local ids) this SLURM task drives, from SLURM's environment.

    One task per node (the shipped sbatch files): all of the node's GPUs, SLURM_GPUS_ON_NODE of them.
    jax's own SLURM detection would give the task GPU SLURM_LOCALID alone, i.e. 1 of 8: 1/8 of the
    job's devices, each with 8x the batch. One task per GPU (tasks per node = GPUs per node): its
    own GPU, SLURM_LOCALID. None (no restriction) when SLURM allocated no GPUs (a CPU job). Any
    other layout is a ConfigError naming the counts.
    """
    gpus = _int_env(env, "SLURM_GPUS_ON_NODE")
    if not gpus:
        return None
    tasks = _int_env(env, "SLURM_NTASKS_PER_NODE")
    if tasks is None:
        count, nodes = _int_env(env, "SLURM_NTASKS") or 1, _int_env(env, "SLURM_JOB_NUM_NODES") or 1
        tasks = count // nodes if count % nodes == 0 else None
    if tasks == 1:
        return list(range(gpus))
    if tasks == gpus:
        return [_int_env(env, "SLURM_LOCALID") or 0]
    raise ConfigError(f"SLURM runs {tasks if tasks is not None else 'an uneven number of'} tasks per node on "
                      f"{gpus} GPUs per node: run one task per node (--ntasks-per-node=1, every GPU to it) "
                      f"or one per GPU (--ntasks-per-node={gpus})")


def topology() -> dict:
    """A one-line description of the job (logged once by process 0)."""
    return {"processes": jax.process_count(), "process_index": jax.process_index(),
            "local_devices": jax.local_device_count(), "global_devices": jax.device_count(),
            "platform": jax.default_backend(), "backend": target(),  # cuda | rocm | cpu | tpu
            "device_kind": jax.devices()[0].device_kind}


def local_batch_rows(global_batch_size: int) -> slice:
    """Rows of the global batch this process provides (processes in order of index)."""
    count = jax.process_count()
    if global_batch_size % count:
        raise ValueError(f"global batch size {global_batch_size} is not divisible by {count} processes")
    per = global_batch_size // count
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def global_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Per-process rows {name: [B/P, S, ...]} -> global arrays [B, S, ...] sharded on `mesh`."""
    out = {}
    for name, rows in local.items():
        sharding = NamedSharding(mesh, batch_spec(mesh, np.ndim(rows)))
        global_shape = (rows.shape[0] * jax.process_count(),) + tuple(rows.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, rows, global_shape)
    return out


def broadcast_int(value: int) -> int:
    """Process 0's `value` on every process (itself when there is one process)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def gather_ints(values: list[int]) -> np.ndarray:
    """[processes, len(values)]: every process's `values` (the same length everywhere), on every
    process (a collective, as max_over_processes)."""
    if jax.process_count() == 1:
        return np.asarray([values], np.int64)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32))).reshape(jax.process_count(), -1)


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (a collective: every process must call it at the same point)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


BARRIER_TIMEOUT_S = 3600  # unless ZAYA_BARRIER_TIMEOUT_S says otherwise
_barriers = 0


def barrier_timeout_s() -> int:
    """How long a process waits for the others (ZAYA_BARRIER_TIMEOUT_S, default an hour)."""
    return _int_env(os.environ, "ZAYA_BARRIER_TIMEOUT_S") or BARRIER_TIMEOUT_S


def barrier(name: str, timeout_s: int | None = None) -> None:
    """Returns once every process has called barrier() as often as this one (`name` says where, in errors).

    The wait goes through jax.distributed's coordination service, whose timeout is ours to choose
    (ZAYA_BARRIER_TIMEOUT_S, default an hour), not through a device collective: on CPU those are gloo's,
    whose first collective on a group of devices waits 30 s for its peers, a limit no setting of jax
    0.10 or 0.11 changes (launch/README.md). Processes reach a program's first collective far apart when their
    compile times differ, and they do: jax writes the persistent compilation cache from process 0 only,
    so every other process compiles from scratch on every start while process 0 loads its programs from
    the cache (a host with a cold cache on a cluster does the same).
    """
    global _barriers
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client jax.distributed.initialize started
    timeout_s = timeout_s or barrier_timeout_s()
    _barriers += 1
    jax_distributed.global_state.client.wait_at_barrier(f"zaya {_barriers}: {name}", 1000 * timeout_s)


_LOCAL_BOARD: dict[str, str] = {}  # the board of a single process


def post(key: str, value: str) -> None:
    """Sets `key` (once per job) on the board every process reads; returns without waiting for anyone."""
    if jax.process_count() == 1:
        _LOCAL_BOARD[key] = value
        return
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.key_value_set(key, value)


def wait_posted(key: str, timeout_s: int) -> str:
    """The value of `key` once some process posted it (TimeoutError-like jax error after `timeout_s`)."""
    if jax.process_count() == 1:
        return _LOCAL_BOARD[key]
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client.blocking_key_value_get(key, 1000 * timeout_s)


def unpost(directory: str) -> None:
    """Removes every key under `directory` (ends with '/') from the board."""
    if jax.process_count() == 1:
        for key in [k for k in _LOCAL_BOARD if k.startswith(directory)]:
            del _LOCAL_BOARD[key]
        return
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.key_value_delete(directory.rstrip("/"))  # the key and all below it


def posted(directory: str) -> dict[str, str]:
    """{key relative to `directory`: value} of every key posted under `directory` (ends with '/') so far."""
    if jax.process_count() == 1:
        return {k[len(directory):]: v for k, v in _LOCAL_BOARD.items() if k.startswith(directory)}
    from jax._src import distributed as jax_distributed
    entries = jax_distributed.global_state.client.key_value_dir_get(directory)
    return {k.rsplit("/", 1)[-1]: v for k, v in entries}
