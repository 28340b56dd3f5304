"""Goodput of a long run under node failures, with and without the local checkpoint tier.

First-order model (Young / Daly): `nodes` nodes each fail independently with mean time between
failures `node_mtbf_h`, so the job fails every node_mtbf_h / nodes hours on average. Each failure
costs the restart (`restart_s`: scheduling, start-up, reading the checkpoint back) plus the work
since the checkpoint the restart uses, on average half its interval: the local tier's
(`local_every` steps) when it survives the failure (one node lost: its neighbour holds its
shards), else the persistent tier's (`every` steps). Each save stalls the loop for its blocking
time (`stall_s`, `local_stall_s`: the device-to-host copy; the write runs behind the steps).

  goodput = 1 - save stalls per second of training - failures per second * (restart + lost work)

  goodput(step_s, nodes, node_mtbf_h, restart_s, every, stall_s, local_every=0, local_stall_s=0.0)
      -> {"goodput", "failures_per_day", "lost_per_failure_s", "save_overhead", "failure_overhead"}
  best_interval_s(stall_s, nodes, node_mtbf_h)
      Young's interval sqrt(2 x stall x job MTBF): where the save stalls and the lost work balance

The restart is taken as equally long from either tier (reading from local disk is faster than
from shared storage; not modelled).
"""

from __future__ import annotations

import math


def goodput(step_s: float, nodes: int, node_mtbf_h: float, restart_s: float, every: int, stall_s: float,
            local_every: int = 0, local_stall_s: float = 0.0) -> dict[str, float]:
    """The fraction of wall time that trains (see the module docstring); local_every=0: no local tier."""
    failures_per_s = nodes / (node_mtbf_h * 3600)
    lost_s = (local_every or every) * step_s / 2
    save = stall_s / (every * step_s) + (local_stall_s / (local_every * step_s) if local_every else 0.0)
    failure = failures_per_s * (restart_s + lost_s)
    return {"goodput": max(0.0, 1 - save - failure), "failures_per_day": failures_per_s * 86400,
            "lost_per_failure_s": lost_s, "save_overhead": save, "failure_overhead": failure}


def best_interval_s(stall_s: float, nodes: int, node_mtbf_h: float) -> float:
    """Young's checkpoint interval in seconds for a save that stalls `stall_s` and a job MTBF of node_mtbf_h / nodes."""
    return math.sqrt(2 * stall_s * node_mtbf_h * 3600 / nodes)
