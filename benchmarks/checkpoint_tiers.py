"""What a local-tier save costs the loop against a persistent save, and goodput at 1,024 GPUs from a
node MTBF, with and without the local tier. Writes benchmarks/results/checkpoint_tiers_cpu.json.

  python benchmarks/checkpoint_tiers.py [--configs configs/demo.py configs/bench_small.py] [--repeats 3]

Per config, in one process (1 CPU device; the trainer's own state on its mesh, as
benchmarks/checkpoint_save.py builds it): the persistent tier's asynchronous save
(zaya_jax.train.checkpoint.Checkpointer, as the loop calls it) and the local tier's
(zaya_jax.train.local_tier.LocalTier.save: this process's shards; with one process there is no
peer copy, whose extra cost is one more device-to-host copy of a neighbour's shards), alternated
in the same run: `blocking_s` is what the loop waits for, `total_s` includes the background write
(median of --repeats after a first save reported apart). Both write to this machine's disk here;
on a cluster the persistent tier writes to shared storage.

Goodput (zaya_jax.planner.goodput): 128 nodes x 8 GPUs, the planner's predicted step of the
shipped mesh (benchmarks/results/planner_predictions.json), a node MTBF from Llama 3's report
(419 unexpected interruptions in 54 days on 16,384 GPUs = 2,048 nodes: 6,335 node-hours between
failures), the sbatch files' intervals (persistent 1000 steps, local 100), and stated assumptions
for what this machine cannot measure (restart time, the persistent save's stall at that scale; the
local save's is that times the ratio measured here for the last config, times 2 for the neighbour's copy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.checkpoint_save import build_state  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh  # noqa: E402
from zaya_jax.planner.goodput import best_interval_s, goodput  # noqa: E402
from zaya_jax.train.checkpoint import Checkpointer  # noqa: E402
from zaya_jax.train.data import SyntheticIterator, synthetic_phase  # noqa: E402
from zaya_jax.train.local_tier import LocalTier  # noqa: E402
from zaya_jax.train.settings import CheckpointSettings, settings_from_config  # noqa: E402

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_tiers_cpu.json")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16384, "gpus_per_node": 8}
ASSUMED = {"restart_s": 600.0, "persistent_stall_s": 2.0, "nodes": 128, "every": 1000, "local_every": 100}


def timed(save, wait) -> tuple[float, float]:
    start = time.perf_counter()
    save()
    blocking = time.perf_counter() - start
    wait()
    return blocking, time.perf_counter() - start


def measure(config_path: str, repeats: int) -> dict:
    settings = settings_from_config(load_config_file(config_path))
    state = build_state(settings, settings.optimizer.name)
    data = SyntheticIterator(synthetic_phase(settings), settings.model.vocab_size, 0)
    config = {"bench": os.path.basename(config_path)}
    root = tempfile.mkdtemp(prefix="tiers_bench_")
    persistent = Checkpointer(os.path.join(root, "persistent"), CheckpointSettings(every_steps=0, max_to_keep=2))
    local = LocalTier(os.path.join(root, "local"), 2, make_mesh(settings.mesh.sizes), "bench")
    times: dict[str, list] = {"persistent": [], "local": []}
    try:
        for _ in range(repeats + 1):  # alternated, so that both see the same load
            state = state.replace(step=state.step + 1)
            jax.block_until_ready(state)
            times["persistent"].append(timed(lambda: persistent.save(state, data, config), persistent.wait))
            state = state.replace(step=state.step + 1)
            jax.block_until_ready(state)
            times["local"].append(timed(lambda: local.save(state, data.get_state(), config), local.wait))
    finally:
        persistent.close()
        local.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {"state_mb": round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20, 1)}
    for tier, rows in times.items():
        out[tier] = {"first_blocking_s": round(rows[0][0], 4), "first_total_s": round(rows[0][1], 4),
                     "blocking_s": round(float(np.median([b for b, _ in rows[1:]])), 4),
                     "total_s": round(float(np.median([t for _, t in rows[1:]])), 4)}
    out["local_vs_persistent_blocking"] = round(out["local"]["blocking_s"] / out["persistent"]["blocking_s"], 3)
    out["local_vs_persistent_total"] = round(out["local"]["total_s"] / out["persistent"]["total_s"], 3)
    return out


def planned_goodput(local_vs_persistent: float, mtbf_scale: float = 1.0) -> dict:
    """Goodput at 128 x 8 GPUs; the local save's stall is the persistent one's times `local_vs_persistent`
    (measured here, bench_small, one process: twice that for the neighbour's copy as well)."""
    with open(os.path.join(REPO, "benchmarks", "results", "planner_predictions.json")) as f:
        step_s = json.load(f)["shipped_config_mesh_xla_attention"][0]["step_s"]
    nodes_hours = LLAMA3["days"] * 24 * LLAMA3["gpus"] / LLAMA3["gpus_per_node"]
    mtbf_h = nodes_hours / LLAMA3["interruptions"] * mtbf_scale
    a = ASSUMED
    local_stall = 2 * a["persistent_stall_s"] * local_vs_persistent
    best = max(1, round(best_interval_s(local_stall, a["nodes"], mtbf_h) / step_s))
    common = dict(step_s=step_s, nodes=a["nodes"], node_mtbf_h=mtbf_h, restart_s=a["restart_s"], every=a["every"],
                  stall_s=a["persistent_stall_s"])
    rounded = lambda d: {k: round(v, 4) for k, v in d.items()}  # noqa: E731
    return {"step_s": round(step_s, 4), "node_mtbf_h": round(mtbf_h, 1), "mtbf_scale": mtbf_scale,
            "source_mtbf": LLAMA3, "assumed": a,
            "persistent_only": rounded(goodput(**common)),
            "local_stall_s": round(local_stall, 4), "best_local_every": best,
            "with_local_tier": rounded(goodput(**common, local_every=a["local_every"], local_stall_s=local_stall)),
            "with_local_tier_at_best_interval": rounded(goodput(**common, local_every=best, local_stall_s=local_stall))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=[os.path.join(REPO, "configs", "demo.py"),
                                                        os.path.join(REPO, "configs", "bench_small.py")])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--goodput-only", action="store_true",
                        help="recompute the goodput part from the saves already in the results file")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    if args.goodput_only:
        with open(RESULT) as f:
            result = json.load(f)
    else:
        saves = {os.path.basename(c): measure(c, args.repeats) for c in args.configs}
        result = {"platform": jax.default_backend(), "devices": jax.device_count(), "saves": saves,
                  "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    ratio = list(result["saves"].values())[-1]["local_vs_persistent_blocking"]
    result["goodput_1024_gpus"] = planned_goodput(ratio)
    result["goodput_1024_gpus_tenth_of_the_mtbf"] = planned_goodput(ratio, 0.1)
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
