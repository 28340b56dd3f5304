"""What a local-tier save costs the loop against a persistent save, and goodput at 1,024 GPUs from a
node MTBF, with and without the local tier. Writes benchmarks/results/checkpoint_tiers_cpu.json.

  python -m benchmarks.checkpoints.checkpoint_tiers [--configs configs/demo.py configs/bench_small.py] [--repeats 3]

Per config, in one process (1 CPU device; the trainer's own state on its mesh, as
benchmarks/checkpoints/checkpoint_save.py builds it): the persistent tier's asynchronous save
(zaya_jax.train.checkpoint.Checkpointer, as the loop calls it) and the local tier's
(zaya_jax.train.local_tier.LocalTier.save: this process's shards; with one process there is no
peer copy, whose extra cost is one more device-to-host copy of a neighbour's shards), alternated
in the same run: `blocking_s` is what the loop waits for, `total_s` includes the background write
(median of --repeats after a first save reported apart). Both write to this machine's disk here;
on a cluster the persistent tier writes to shared storage.

Goodput (zaya_jax.planner.goodput): 128 nodes x 8 GPUs, the planner's predicted step of the
shipped mesh (benchmarks/results/planner_predictions.json), a node MTBF from Llama 3's report
(419 unexpected interruptions in 54 days on 16,384 GPUs = 2,048 nodes: 6,335 node-hours between
failures), the sbatch files' intervals (persistent 1000 steps, local 100), each tier's write and
restore time from the state's bytes (ZAYA1-base's parameters and optimizer state, the planner's
count) and a rate: the persistent tier at the job's share of Llama 3's sustained storage throughput
(2 TB/s for 16,384 GPUs), the local tier at the write rate measured here for the last config; and
stated assumptions for what this machine cannot measure (the restart's scheduling and start-up,
the persistent save's stall at that scale; the local save's is that times the ratio measured here
for the last config, times 2 for the neighbour's copy) and, as a second case, the stalls of the
device-to-host copy alone at Orbax's 32 GB/s (each GPU's even share of the state; twice for the local
tier). Rows of goodput against each tier's interval, for each stall case at that storage share and a
tenth and a hundredth of it.

  python -m benchmarks.checkpoints.checkpoint_tiers --goodput-only   recomputes the goodput part from the saves
                                                         already in the results file (no saves)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.checkpoints.checkpoint_save import build_state  # noqa: E402
from benchmarks.planner.planner_predictions import base_shape  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh  # noqa: E402
from zaya_jax.planner.goodput import (INTERVAL_STEPS, LLAMA3, ORBAX, against_the_interval, best_every,  # noqa: E402
                                      goodput, llama3_node_mtbf_h, llama3_storage_share_gbps, tier_seconds)
from zaya_jax.planner.step_plan import parameter_memory  # noqa: E402
from zaya_jax.train.checkpoint import Checkpointer  # noqa: E402
from zaya_jax.train.data import SyntheticIterator, synthetic_phase  # noqa: E402
from zaya_jax.train.local_tier import LocalTier  # noqa: E402
from zaya_jax.train.settings import CheckpointSettings, settings_from_config  # noqa: E402

from benchmarks.common import REPO, RESULTS  # noqa: E402
RESULT = os.path.join(RESULTS, "checkpoint_tiers_cpu.json")
ASSUMED = {"restart_s": 600.0, "restart_is": "scheduling and start-up, before reading the checkpoint back",
           "persistent_stall_s": 2.0, "nodes": 128, "every": 1000, "local_every": 100,
           "storage": "the job's GPU share of Llama 3's sustained 2 TB/s, reads as fast as writes",
           "local_disk": "each node's disk writes and reads at the local tier's write rate measured here"}
STORAGE_SCALES = (1.0, 0.1, 0.01)


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


def state_bytes() -> float:
    """Bytes of ZAYA1-base's checkpointed state: its parameters and optimizer state (float32, each once)."""
    config = load_config_file(os.path.join(REPO, "configs", "zaya1_base.py"))
    memory = parameter_memory(model_config(config), {}, base_shape(config))
    return memory["params"] + memory["optimizer_state"]


def local_write_gbps(save: dict) -> float:
    """The local tier's write rate measured here: the state's bytes over its save's time behind the loop."""
    return save["state_mb"] * 2**20 / (save["local"]["total_s"] - save["local"]["blocking_s"]) / 1e9


def planned_goodput(save: dict, mtbf_scale: float = 1.0) -> dict:
    """Goodput at 128 x 8 GPUs from the last config's measured save (`save`, one row of "saves"), for each
    storage share in STORAGE_SCALES and each of two stall cases: "assumed", the persistent save's stall
    ASSUMED and the local one's that times its measured blocking ratio, twice (the neighbour's copy);
    "orbax_d2h", the device-to-host copy alone at Orbax's rate of each GPU's even share of the state
    (twice for the local tier). The first case's figures are also the top level's."""
    with open(os.path.join(REPO, "benchmarks", "results", "planner_predictions.json")) as f:
        step_s = json.load(f)["shipped_config_mesh_xla_attention"][0]["step_s"]
    a = ASSUMED
    mtbf_h = llama3_node_mtbf_h() * mtbf_scale
    gpus = a["nodes"] * LLAMA3["gpus_per_node"]
    nbytes, local_gbps = state_bytes(), local_write_gbps(save)
    storage_gbps = llama3_storage_share_gbps(gpus)
    d2h_s = nbytes / gpus / (ORBAX["d2h_gbps"] * 1e9)
    stalls = {"assumed": (a["persistent_stall_s"], 2 * a["persistent_stall_s"] * save["local_vs_persistent_blocking"]),
              "orbax_d2h": (d2h_s, 2 * d2h_s)}
    rounded = lambda d: {k: round(v, 4) for k, v in d.items()}  # noqa: E731

    def case(storage_scale: float, stall: str) -> dict:
        stall_s, local_stall = stalls[stall]
        times = tier_seconds(nbytes, a["nodes"], storage_gbps * storage_scale, local_gbps)
        common = dict(step_s=step_s, nodes=a["nodes"], node_mtbf_h=mtbf_h, restart_s=a["restart_s"],
                      stall_s=stall_s, write_s=times["write_s"], restore_s=times["restore_s"])
        local = dict(local_stall_s=local_stall, local_write_s=times["local_write_s"],
                     local_restore_s=times["local_restore_s"])
        best = best_every(step_s, local_stall, a["nodes"], mtbf_h, times["local_write_s"], divides=a["every"])
        best_persistent = best_every(step_s, stall_s, a["nodes"], mtbf_h, times["write_s"])
        return {"storage_scale": storage_scale, "storage_gbps": round(storage_gbps * storage_scale, 3),
                "stall": stall, "stall_s": round(stall_s, 4), "local_stall_s": round(local_stall, 4),
                **{k: round(v, 4) for k, v in times.items()},
                "persistent_only": rounded(goodput(**common, every=a["every"])),
                "best_persistent_every": best_persistent,
                "persistent_only_at_best_interval": rounded(goodput(**common, every=best_persistent)),
                "with_local_tier": rounded(goodput(**common, every=a["every"], local_every=a["local_every"], **local)),
                "best_local_every": best,
                "with_local_tier_at_best_interval": rounded(goodput(**common, every=a["every"], local_every=best,
                                                                    **local)),
                "against_the_interval": against_the_interval(INTERVAL_STEPS, a["every"], local, **common)}

    cases = [case(scale, stall) for stall in stalls for scale in STORAGE_SCALES]
    return {"step_s": round(step_s, 4), "node_mtbf_h": round(mtbf_h, 1), "mtbf_scale": mtbf_scale,
            "source": LLAMA3, "source_stall": ORBAX, "assumed": a, "state_gb": round(nbytes / 1e9, 2),
            "local_write_gbps_measured": round(local_gbps, 3), **cases[0], "cases": cases[1:]}


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
    save = list(result["saves"].values())[-1]
    result["goodput_1024_gpus"] = planned_goodput(save)
    result["goodput_1024_gpus_tenth_of_the_mtbf"] = planned_goodput(save, 0.1)
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
