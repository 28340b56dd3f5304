"""Goodput of a long run under node failures, with and without the local checkpoint tier.

First-order model (Young / Daly): `nodes` nodes each fail independently with mean time between
failures `node_mtbf_h`, so the job fails at rate nodes / (node_mtbf_h x 3600) per second. Each tier
saves every `every` steps; a save stalls the loop for its blocking time (`stall_s`: the
device-to-host copy) and commits `write_s` later (the write runs behind the steps). A save first
waits for its tier's previous one to commit (the trainer's Checkpointer, as Orbax's manager; a
shorter setting would stall the loop instead), so the model takes its interval as

  interval = max(every x step_s, write_s)

A failure at a uniform instant loses the work since the start of the newest committed save: half an
interval plus the save in flight, interval / 2 + write_s, of the tier it restores from (the local
tier when it survives: one node lost, its neighbour holds its shards; else the persistent tier).
It costs the restart (`restart_s`: scheduling and start-up) plus reading that tier back (`restore_s`).

  goodput = 1 - sum over tiers of stall / interval
              - failures per second x (restart + restore + interval / 2 + write)   [the restoring tier's]

  goodput(step_s, nodes, node_mtbf_h, restart_s, every, stall_s, write_s=0, restore_s=0,
          local_every=0, local_stall_s=0, local_write_s=0, local_restore_s=0)
      -> {"goodput", "failures_per_day", "interval_s", "local_interval_s", "lost_per_failure_s",
          "restore_s", "save_overhead", "failure_overhead"}
  best_interval_s(stall_s, nodes, node_mtbf_h, write_s=0)
      Young's interval sqrt(2 x stall x job MTBF), where the save stalls and the lost work balance,
      and never under the write (the goodput above is convex in the interval, so the clamp is the optimum)
  best_every(step_s, stall_s, nodes, node_mtbf_h, write_s=0, divides=0)
      that interval in whole steps (a divisor of `divides` when given: the trainer's local_every)
  against_the_interval(everies, persistent_every, local, **common)
      goodput of each tier against its interval in steps (the rows the planner and the benchmark print)
  tier_seconds(state_bytes, nodes, storage_gbps, local_gbps)
      each tier's write and restore seconds from its rates (see the function)
  LLAMA3, ORBAX: the published figures the defaults and the benchmark's cases come from
"""

from __future__ import annotations

import math

# The Llama 3 Herd of Models (Meta, 2024), section 3.3.4: 419 unexpected interruptions in 54 days
# of the 405B pretraining on 16,384 H100s (8 a server); section 3.3.1: checkpoints go to Tectonic,
# 2 TB/s sustained, 7 TB/s peak, each GPU's model state 1 MB to 4 GB.
LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16384, "gpus_per_node": 8,
          "storage_sustained_gbps": 2000.0, "storage_peak_gbps": 7000.0}
# Orbax's "Maximizing Performance" guide (orbax.readthedocs.io, checkpoint v1): an async save's blocking
# time is mostly the device-to-host copy, e.g. 32 GB/s with TPU PCIe Gen5.
ORBAX = {"d2h_gbps": 32.0}
# The intervals (steps) the planner and the benchmark print goodput against.
INTERVAL_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def llama3_node_mtbf_h() -> float:
    """Llama 3's node-hours per unexpected interruption (each taken as one node's failure)."""
    nodes = LLAMA3["gpus"] / LLAMA3["gpus_per_node"]
    return LLAMA3["days"] * 24 * nodes / LLAMA3["interruptions"]


def llama3_storage_share_gbps(gpus: int) -> float:
    """A job of `gpus` GPUs' share of Llama 3's sustained storage throughput, in proportion to its GPUs."""
    return LLAMA3["storage_sustained_gbps"] * gpus / LLAMA3["gpus"]


def tier_seconds(state_bytes: float, nodes: int, storage_gbps: float, local_gbps: float) -> dict[str, float]:
    """Write and restore seconds of each tier for a training state of `state_bytes` (every array once).
    Persistent: the whole state through shared storage at the job's aggregate `storage_gbps`, both ways.
    Local: each node its 1/nodes share at its own disk's `local_gbps`, written twice (its own copy and
    its neighbour's peer copy), read once. Reads are taken at the write rates."""
    persistent = state_bytes / (storage_gbps * 1e9)
    node_share = state_bytes / nodes / (local_gbps * 1e9)
    return {"write_s": persistent, "restore_s": persistent, "local_write_s": 2 * node_share,
            "local_restore_s": node_share}


def goodput(step_s: float, nodes: int, node_mtbf_h: float, restart_s: float, every: int, stall_s: float,
            write_s: float = 0.0, restore_s: float = 0.0, local_every: int = 0, local_stall_s: float = 0.0,
            local_write_s: float = 0.0, local_restore_s: float = 0.0) -> dict[str, float]:
    """The fraction of wall time that trains (see the module docstring); local_every=0: no local tier."""
    failures_per_s = nodes / (node_mtbf_h * 3600)
    interval = max(every * step_s, write_s)
    save = stall_s / interval
    lost, restore, local_interval = interval / 2 + write_s, restore_s, 0.0
    if local_every:
        local_interval = max(local_every * step_s, local_write_s)
        save += local_stall_s / local_interval
        lost, restore = local_interval / 2 + local_write_s, local_restore_s
    failure = failures_per_s * (restart_s + restore + lost)
    return {"goodput": max(0.0, 1 - save - failure), "failures_per_day": failures_per_s * 86400,
            "interval_s": interval, "local_interval_s": local_interval, "lost_per_failure_s": lost,
            "restore_s": restore, "save_overhead": save, "failure_overhead": failure}


def best_interval_s(stall_s: float, nodes: int, node_mtbf_h: float, write_s: float = 0.0) -> float:
    """Young's checkpoint interval in seconds for a save that stalls `stall_s` and a job MTBF of
    node_mtbf_h / nodes, clamped at the save's write time `write_s`."""
    return max(math.sqrt(2 * stall_s * node_mtbf_h * 3600 / nodes), write_s)


def best_every(step_s: float, stall_s: float, nodes: int, node_mtbf_h: float, write_s: float = 0.0,
               divides: int = 0) -> int:
    """best_interval_s in whole steps, rounded up; with `divides`: the largest divisor of it at most that."""
    steps = max(1, math.ceil(best_interval_s(stall_s, nodes, node_mtbf_h, write_s) / step_s))
    return max(n for n in range(1, min(steps, divides) + 1) if divides % n == 0) if divides else steps


def against_the_interval(everies, persistent_every: int, local: dict, **common) -> list[dict]:
    """Per n in `everies`: goodput of the persistent tier alone every n steps, and of the local tier
    (`local`: its goodput arguments but local_every) every n steps over the persistent tier every
    `persistent_every` (None where n does not divide it); each interval after the clamp at its write.
    `common`: goodput's other arguments but `every`."""
    rows = []
    for n in everies:
        plain = goodput(**common, every=n)
        tiers = goodput(**common, every=persistent_every, local_every=n, **local) if persistent_every % n == 0 else None
        rows.append({"every": n, "persistent_only": round(plain["goodput"], 4),
                     "persistent_interval_s": round(plain["interval_s"], 4),
                     "with_local_tier": None if tiers is None else round(tiers["goodput"], 4),
                     "local_interval_s": None if tiers is None else round(tiers["local_interval_s"], 4)})
    return rows
