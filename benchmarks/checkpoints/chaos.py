"""Chaos campaign on `python -m zaya_jax.train` (configs/tiny.py, CPU): kills, damaged checkpoints,
stops of a 2-process job. Writes benchmarks/results/chaos_cpu.json.

  python -m benchmarks.checkpoints.chaos [--kills 30] [--commit-kills 10] [--steps 60]
  python -m benchmarks.checkpoints.chaos --only stops   # one phase (kills, commit_kills, damage, stops, tiers) into the existing file
  python -m benchmarks.checkpoints.chaos --only tiers [--tier-kills 6]

1. Kills: one workdir, restarted after each SIGKILL until the run finishes (then a new one). Most
   kills land 1 to 8 steps into a run plus a random fraction of a step (some during an
   asynchronous checkpoint write: a `*.orbax-checkpoint-tmp*` directory is left behind, or the
   step is renamed but has no manifest yet); every 5th is forced inside a write (the
   test wrapper's KILL_IN_SAVE: after the data, before Orbax renames the step into place). After
   each kill the restart must resume from the newest checkpoint Orbax committed (its step
   directory under its final name with Orbax's commit_success.txt: a lost state when it starts
   earlier); at the end every loss logged by any attempt must equal the
   uninterrupted reference run's loss at that step bit for bit (a silently wrong state: any
   difference).
2. Kills at the commit: one workdir; each attempt is SIGKILLed the instant Orbax has renamed the
   next checkpoint into place (the wrapper's KILL_AFTER_COMMIT, in Orbax's commit thread), the
   moment a scheduler's preemption right after a save hits. Each restart must resume from exactly
   that step (a lost checkpoint otherwise), and every logged loss must equal the reference's.
3. Damage: each variant of tests.train_helpers.DAMAGE applied to the newest checkpoint of a
   finished run, then the run resumed with 4 more steps: it must restore the previous checkpoint,
   name what it skipped, and log the reference's losses; with every checkpoint damaged it must
   refuse (exit 2) naming each step.
4. Multi-host stops (2 processes x 1 CPU device, ZAYA_* environment as launch/local.sh sets):
   SIGTERM to one process, to both 0.3 s apart, twice 5 ms apart, SIGINT, SIGTERM during start-up.
   Each must end with both processes exiting 75 within 10 s of the (last) signal, having saved the
   same step (or, for a signal while the processes build their state, both saying they stop during
   start-up, nothing saved). Also timed: the per-step stop agreement (an all-gather of one int32) against the
   step itself, from the same job's metrics (the machine was shared: ratios, not absolutes).
5. Tiers (checkpoint.local_dir, 2 processes x 1 CPU device, fsdp=2, local tier every 2 steps, persistent
   every 4): each attempt is SIGKILLed (both processes) at a random instant after a random step, then a
   random tier loss: none, one process's whole local directory deleted (a replaced node), or one
   process's newest own copy damaged (flipped bytes); the restart must resume (0 runs lost), every
   loss any attempt logged must equal an uninterrupted run's of the same mesh shape (one process,
   fsdp=2) to 1e-6 relative (0 silently wrong), and the work lost per failure (the newest step logged
   before the kill minus the step restored) is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.train_helpers import (DAMAGE, REPO, WRAPPER, Job, cli_env, flip_bytes_of_item, free_port,  # noqa: E402
                                 run_train)
from zaya_jax.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USER_ERROR  # noqa: E402
from zaya_jax.checkpoints import integrity  # noqa: E402

RESULT = os.path.join(REPO, "benchmarks", "results", "chaos_cpu.json")
FAST = ("--config.optimizer.warmup_steps=1", "--config.optimizer.name=adamw", "--config.train.log_every_steps=1",
        "--config.eval.every_steps=0", "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=0",
        "--config.monitor.progress_bar=False")
EVERY = 4


def all_losses(workdir) -> list[tuple[int, float]]:
    """Every (step, loss) any attempt logged, in order (not only the last of each step)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line a SIGKILL cut short
                continue
            if record.get("kind") == "train":
                out.append((record["step"], record["loss"]))
    return out


def start_step(output: str) -> int | None:
    for line in output.splitlines():
        if line.startswith("start at step "):
            return int(line.split()[3].rstrip(":"))
    return None


def newest_committed(workdir: str) -> int:
    """The newest step Orbax committed in `workdir` (0 when none): what a restart must resume from."""
    directory = os.path.join(workdir, "checkpoints")
    return next((s for s in integrity.steps_in(directory)
                 if os.path.isfile(os.path.join(directory, str(s), integrity.COMMIT_RECORDS[1]))), 0)


def kills(root: str, steps: int, count: int, reference: dict[int, float], rng: random.Random) -> dict:
    """SIGKILLs until `count`, each followed by a restart; a chain that finishes is checked and a new one begun."""
    trials, attempts, chains, wrong, complete = [], [], 0, [], True
    while len(trials) < count:
        chains += 1
        workdir = os.path.join(root, f"kills_{chains}")
        while True:
            attempt = _attempt(root, workdir, steps, len(attempts), in_save=len(trials) % 5 == 4,
                               kill=len(trials) < count, rng=rng)
            attempts.append(attempt)
            if attempt["exit"] == -signal.SIGKILL:
                trials.append(attempt)
                continue
            if attempt["exit"] != 0:
                raise RuntimeError(f"attempt {len(attempts)} exited {attempt['exit']}:\n{attempt['output'][-3000:]}")
            break
        logged = all_losses(workdir)
        wrong += [(chains, s) for s, loss in logged if reference.get(s) != loss]
        complete &= sorted({s for s, _ in logged}) == sorted(reference)
    for a in attempts:
        del a["output"]
    checked = [a for a in attempts if a["start"] is not None]
    return {"kills": len(trials), "kills_in_save_forced": sum(t["in_save"] for t in trials),
            "kills_during_async_write": sum(t["during_async_write"] for t in trials), "chains": chains,
            "restarts": len(attempts) - chains, "resumes_checked": len(checked),
            "lost_states": sum(a["start"] != a["expected_start"] for a in checked),
            "silently_wrong_steps": wrong, "every_step_logged": complete, "attempts": attempts}


def _attempt(root: str, workdir: str, steps: int, index: int, in_save: bool, kill: bool, rng: random.Random) -> dict:
    """One run of the CLI on `workdir`, SIGKILLed (if `kill`) at a random time after its first step or
    (if `in_save`) inside the write of its first checkpoint."""
    expected_start = newest_committed(workdir)
    env, command = cli_env(), [sys.executable, "-m", "zaya_jax.train"]
    in_save = kill and in_save and ((expected_start or 0) // EVERY + 1) * EVERY < steps
    if in_save:
        env["KILL_IN_SAVE"], command = str(((expected_start or 0) // EVERY + 1) * EVERY), [sys.executable, "-c", WRAPPER]
    log = open(os.path.join(root, f"attempt_{index}.log"), "w+")
    process = subprocess.Popen([*command, "--config", "configs/tiny.py", "--workdir", workdir, *FAST,
                                f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={EVERY}"],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if kill and not in_save:  # after 1 to 2 * EVERY steps, then a random part of a step (or of a save)
        target = len(all_losses(workdir)) + rng.randint(1, 2 * EVERY)
        started = time.time()
        while len(all_losses(workdir)) < target and process.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, min(time.time() - started, 2.0) / 2))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
    code = process.wait()
    log.seek(0)
    output = log.read()
    log.close()
    directory = os.path.join(workdir, "checkpoints")
    entries = os.listdir(directory) if os.path.isdir(directory) else []
    return {"expected_start": expected_start or 0, "start": start_step(output), "exit": code, "in_save": in_save,
            "killed_after_step": max([s for s, _ in all_losses(workdir)], default=0),
            "during_async_write": code == -signal.SIGKILL and any("orbax-checkpoint-tmp" in e for e in entries),
            "output": output}


def commit_kills(root: str, steps: int, count: int, reference: dict[int, float]) -> dict:
    """`count` SIGKILLs, each the instant checkpoint EVERY * k is committed, on one workdir; then it finishes."""
    workdir, trials = os.path.join(root, "commit_kills"), []
    for k in range(1, count + 2):
        commit = k * EVERY if k <= count else None
        env = {**cli_env(), **({"KILL_AFTER_COMMIT": str(commit)} if commit else {})}
        result = subprocess.run([sys.executable, "-c", WRAPPER, "--config", "configs/tiny.py", "--workdir", workdir,
                                 *FAST, f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={EVERY}"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        start = start_step(result.stdout)
        if trials:  # this attempt's start is the previous kill's outcome
            trials[-1]["restart_resumed_from"] = start
        if commit is None:
            if result.returncode != 0:
                raise RuntimeError(f"the final attempt exited {result.returncode}:\n{result.stderr[-3000:]}")
            break
        step_dir = os.path.join(workdir, "checkpoints", str(commit))
        trials.append({"killed_at_commit_of": commit, "exit": result.returncode,
                       "committed": os.path.isfile(os.path.join(step_dir, integrity.COMMIT_RECORDS[1])),
                       "sealed": integrity.problem(step_dir, integrity.ITEMS["training"]) is None})
    logged = all_losses(workdir)
    lost = [t for t in trials if t["restart_resumed_from"] != t["killed_at_commit_of"]]
    return {"kills": len(trials), "killed_by_sigkill": sum(t["exit"] == -signal.SIGKILL for t in trials),
            "committed_when_killed": sum(t["committed"] for t in trials),
            "sealed_when_killed": sum(t["sealed"] for t in trials), "lost_checkpoints": len(lost),
            "silently_wrong_steps": [s for s, loss in logged if reference.get(s) != loss],
            "every_step_logged": sorted({s for s, _ in logged}) == sorted(reference), "trials": trials}


def damage(root: str, reference_dir: str, steps: int, reference: dict[int, float]) -> dict:
    results = {}
    newest = steps - EVERY  # the reference's checkpoints: ..., steps - EVERY, steps (damaged: the newest below)
    for variant, (damage_fn, _) in DAMAGE.items():
        workdir = os.path.join(root, "damage_" + variant.replace(" ", "_"))
        shutil.copytree(reference_dir, workdir, ignore=shutil.ignore_patterns(".lock", "metrics.jsonl"))
        shutil.rmtree(os.path.join(workdir, "checkpoints", str(steps)))
        damage_fn(os.path.join(workdir, "checkpoints", str(newest)))
        result = run_train(workdir, *FAST, f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={EVERY}")
        skipped = [ln for ln in result.stdout.splitlines() if ln.startswith(f"checkpoint {newest} skipped")]
        losses = dict(all_losses(workdir))
        results[variant] = {"exit": result.returncode, "skipped_line": skipped[0] if skipped else None,
                            "restored": start_step(result.stdout),
                            "losses_equal_reference": bool(losses) and all(reference[s] == v for s, v in losses.items()),
                            "ok": result.returncode == 0 and bool(skipped) and start_step(result.stdout) == newest - EVERY
                            and all(reference[s] == v for s, v in losses.items())}
    workdir = os.path.join(root, "damage_all")
    shutil.copytree(reference_dir, workdir, ignore=shutil.ignore_patterns(".lock"))
    for step in integrity.steps_in(os.path.join(workdir, "checkpoints")):
        DAMAGE["flipped bytes"][0](os.path.join(workdir, "checkpoints", str(step)))
    result = run_train(workdir, *FAST, f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={EVERY}")
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    results["every checkpoint damaged"] = {"exit": result.returncode, "message": last[:400],
                                           "ok": result.returncode == EXIT_USER_ERROR and "no whole checkpoint" in last}
    return results


STOP_IN_START_UP = "stopping during start-up, before training; nothing new to save"


def stop_step(output: str) -> int | None:
    """The step a process says it stopped at ("saving step N" or "stopping at step N")."""
    found = re.search(r"(?:saving step|stopping at step) (\d+)", output)
    return int(found.group(1)) if found else None


def stops(root: str) -> dict:
    """Each variant on a fresh 2-process job; seconds from the (last) signal until both processes exited."""
    variants = {
        "SIGTERM to process 1": [(1, signal.SIGTERM, 0.0)],
        "SIGTERM to both, 0.3 s apart": [(0, signal.SIGTERM, 0.0), (1, signal.SIGTERM, 0.3)],
        "two SIGTERMs 5 ms apart to process 0": [(0, signal.SIGTERM, 0.0), (0, signal.SIGTERM, 0.005)],
        "SIGINT to process 0": [(0, signal.SIGINT, 0.0)],
        "SIGTERM to process 1 during start-up": [(1, signal.SIGTERM, 0.0)],
    }
    results = {}
    for name, signals in variants.items():
        workdir = os.path.join(root, "stop_" + str(len(results)))
        job = Job(Path(workdir), *FAST, "--config.train.steps=100000", "--config.checkpoint.every_steps=0")
        if "start-up" in name:
            job.wait_for("topology:")
        else:
            job.wait_for_step(2)
        for process, signum, delay in signals:
            time.sleep(delay)
            job.signal(process, signum)
        codes, seconds = job.finish(timeout=120)
        saved = [integrity.steps_in(os.path.join(workdir, "checkpoints"))]
        steps_named = [stop_step(job.output(i)) for i in range(2)]
        in_start_up = [STOP_IN_START_UP in job.output(i) for i in range(2)]
        trained = "saving step" in job.output(0)  # else it stopped before its first step: nothing new to save
        agreed = (all(in_start_up) and saved[0] == []
                  or steps_named[0] == steps_named[1] is not None
                  and saved[0][:1] == ([steps_named[0]] if trained else []))
        results[name] = {"exits": codes, "seconds_to_exit": round(seconds, 2), "saved_steps": saved[0],
                         "step_named_by_each_process": steps_named, "stopped_during_start_up": in_start_up,
                         "ok": codes == [EXIT_PREEMPTED] * 2 and seconds < 10 and agreed}
    results["agreement_cost"] = agreement_cost(os.path.join(root, "stop_0"))  # a job that trained
    return results


def agreement_cost(workdir: str) -> dict:
    """The per-step all-gather, timed in a 2-process job, against the mean step time of `workdir`'s run."""
    port = free_port()
    code = ("import time, numpy as np; from zaya_jax.parallel import distributed as d; d.initialize(); "
            "d.max_over_processes(0); t=time.perf_counter(); [d.max_over_processes(1) for _ in range(200)]; "
            "print('PER_CALL', (time.perf_counter()-t)/200)")
    processes = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True, env={
        **cli_env(), "ZAYA_COORDINATOR": f"127.0.0.1:{port}", "ZAYA_NUM_PROCESSES": "2", "ZAYA_PROCESS_ID": str(i),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}) for i in range(2)]
    per_call = [float(p.communicate(timeout=300)[0].split("PER_CALL")[1]) for p in processes]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rates = [json.loads(line)["tokens_per_sec"] for line in f if '"kind": "train"' in line][2:]
    step_seconds = 8 * 64 / (sum(rates) / len(rates))  # tiny: 8 x 64 tokens per step
    return {"allgather_seconds_per_step": max(per_call), "step_seconds": step_seconds,
            "ratio_to_step": max(per_call) / step_seconds}


def tiers(root: str, steps: int, count: int, rng: random.Random) -> dict:
    """SIGKILLs of a 2-process job with a local tier, each followed by a random tier loss and a restart."""
    run = (*FAST, "--config.mesh.fsdp=2", f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={EVERY}")
    reference_dir = os.path.join(root, "tiers_reference")
    result = run_train(reference_dir, *run)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = dict(all_losses(reference_dir))
    trials, chains, wrong, lost_runs = [], 0, [], 0
    while len(trials) < count:
        chains += 1
        workdir, local = Path(root) / f"tiers_{chains}", Path(root) / f"tiers_{chains}_local"
        tier = (f"--config.checkpoint.local_dir={local}", f"--config.checkpoint.local_every={LOCAL_EVERY}")
        while True:
            before = len(all_losses(workdir))  # this attempt's records come after these
            job = Job(workdir, *run, *tier)
            killing = len(trials) < count
            if killing:
                try:
                    job.wait_for("start at step ")
                    beyond = rng.randint(start_step(job.output(0)) + 1, steps - 1)
                    deadline = time.time() + 600
                    while max((s for s, _ in all_losses(workdir)[before:]), default=-1) < beyond:
                        job.check_running(deadline, f"never logged step {beyond}")
                        time.sleep(0.05)
                except (AssertionError, ValueError):  # the job ended first (or started at its last step)
                    killing = False
            if killing:
                time.sleep(rng.uniform(0, 1.5))
                logged = max(s for s, _ in all_losses(workdir)[before:])
                for i in (0, 1):
                    job.signal(i, signal.SIGKILL)
            codes, _ = job.finish(timeout=600)
            start = start_step(job.output(0))
            if trials and trials[-1]["restored"] is None and start is not None:
                trials[-1].update(restored=start, lost_steps=trials[-1]["newest_step_logged"] - start,
                                  from_local="restored local step" in job.output(0))
            if codes == [0, 0]:
                break
            # a process whose peer was killed ends too: SIGABRT (the coordinator gone) or exit 1 (its
            # collective's gloo error, cli.exit_failed_now)
            if not killing or any(code not in (-signal.SIGKILL, -signal.SIGABRT, EXIT_FAILED) for code in codes):
                lost_runs += 1
                break
            loss = rng.choice(["none", "process_0 directory", "process_1 directory", "damaged own copy"])
            if loss.endswith("directory"):
                shutil.rmtree(local / loss.split()[0], ignore_errors=True)
            elif loss == "damaged own copy":
                victim = local / f"process_{rng.randint(0, 1)}" / "own"
                saved = integrity.steps_in(str(victim))
                if saved:
                    flip_bytes_of_item(victim / str(saved[0]), "state")
            trials.append({"chain": chains, "killed_after_step": beyond, "newest_step_logged": logged, "tier_loss": loss,
                           "restored": None})
        logged = all_losses(workdir)
        wrong += [(chains, s) for s, value in logged if abs(value - reference[s]) > 1e-6 * abs(reference[s])]
    finished = [t for t in trials if t["restored"] is not None]
    return {"kills": len(trials), "chains": chains, "runs_lost": lost_runs, "silently_wrong_steps": wrong,
            "restores_from_local": sum(t["from_local"] for t in finished),
            "max_lost_steps": max((t["lost_steps"] for t in finished), default=None),
            "mean_lost_steps": round(sum(t["lost_steps"] for t in finished) / max(len(finished), 1), 2),
            "local_every": LOCAL_EVERY, "persistent_every": EVERY, "trials": trials}


LOCAL_EVERY = 2
PHASES = ("kills", "commit_kills", "damage", "stops", "tiers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--commit-kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tier-kills", type=int, default=6)
    parser.add_argument("--only", choices=PHASES, help="re-run one phase, into the existing results file")
    args = parser.parse_args()
    if args.commit_kills * EVERY >= args.steps:
        parser.error(f"--commit-kills {args.commit_kills} needs --steps above {args.commit_kills * EVERY}")
    root = tempfile.mkdtemp(prefix="zaya_chaos_")
    started = time.time()
    out = {"machine": "2 shared CPU cores (other jobs running): times are indicative",
           "config": "configs/tiny.py, adamw, 8 CPU devices (1 per process for the 2-process job)",
           "steps": args.steps, "checkpoint_every_steps": EVERY}
    if args.only:
        with open(RESULT) as f:
            out = json.load(f)
    reference_dir = os.path.join(root, "reference")
    if args.only not in ("stops", "tiers"):
        result = run_train(reference_dir, *FAST, f"--config.train.steps={args.steps}",
                           f"--config.checkpoint.every_steps={EVERY}")
        assert result.returncode == 0, result.stderr[-3000:]
    reference = dict(all_losses(reference_dir)) if args.only not in ("stops", "tiers") else {}
    for phase in PHASES if args.only is None else (args.only,):
        if phase == "kills":
            out["kill_trials"] = kills(root, args.steps, args.kills, reference, random.Random(args.seed))
        elif phase == "commit_kills":
            out["commit_kills"] = commit_kills(root, args.steps, args.commit_kills, reference)
        elif phase == "damage":
            out["damage"] = damage(root, reference_dir, args.steps, reference)
        elif phase == "stops":
            out["multihost_stops"] = stops(root)
        else:
            out["tiers"] = tiers(root, 16, args.tier_kills, random.Random(args.seed))
        _write(out)
    out["summary"] = summary(out, wall_seconds=round(time.time() - started) if args.only is None else None)
    _write(out)
    print(json.dumps(out["summary"]))
    shutil.rmtree(root, ignore_errors=True)


def summary(out: dict, wall_seconds: int | None) -> dict:
    """The headline figures of every phase in `out` (wall_seconds: of a whole campaign, else the last one's)."""
    k, c = out["kill_trials"], out.get("commit_kills")
    return {"kills": k["kills"], "kills_during_async_write": k["kills_during_async_write"],
            "lost_states": k["lost_states"], "silently_wrong_steps": len(k["silently_wrong_steps"]),
            **({"kills_at_commit": c["kills"], "checkpoints_lost_at_commit": c["lost_checkpoints"],
                "silently_wrong_steps_after_commit_kills": len(c["silently_wrong_steps"])} if c else {}),
            "damage_variants_ok": f"{sum(v['ok'] for v in out['damage'].values())}/{len(out['damage'])}",
            **stop_summary(out["multihost_stops"]),
            **({"tier_kills": out["tiers"]["kills"], "tier_runs_lost": out["tiers"]["runs_lost"],
                "tier_silently_wrong_steps": len(out["tiers"]["silently_wrong_steps"]),
                "tier_max_lost_steps": out["tiers"]["max_lost_steps"]} if "tiers" in out else {}),
            "wall_seconds": wall_seconds if wall_seconds is not None else out.get("summary", {}).get("wall_seconds")}


def stop_summary(stops_out: dict) -> dict:
    variants = [v for name, v in stops_out.items() if name != "agreement_cost"]
    return {"stop_variants_ok": f"{sum(v['ok'] for v in variants)}/{len(variants)}",
            "max_seconds_to_exit": max(v["seconds_to_exit"] for v in variants)}


def _write(out: dict) -> None:
    """The results so far (each phase adds its part)."""
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
