"""The shipped launch files: the MI300X job is valid in every curriculum phase, resumes, saves on
an early signal, and local.sh gives each process its own GPUs.

The planner runs on exactly the job's configuration: configs/zaya1_base.py with the overrides on
the sbatch's srun line, at nodes x GPUs per node devices, for every phase, and must fit 192 GB
(MI300X) or 141 GB (H200). The phase's batch must also pass the trainer's own layout check, and
the job's mesh must be the one the planner's search (`plan --search`) picks for all phases on that
GPU, searched again by the test (and recorded in benchmarks/results/planner_predictions.json,
written by benchmarks/planner/planner_predictions.py).
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.fake_devices import xla_flags
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.data import parse_phases
from zaya_jax.parallel.mesh import phase_mesh_sizes, resolve_mesh_shape
from zaya_jax.planner.step_plan import StepShape, plan
from zaya_jax.train.settings import check_batch_layout, settings_from_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = {"mi300x": "launch/slurm_mi300x.sbatch", "h200": "launch/slurm_h200.sbatch"}
MEMORY_GB = {"mi300x": 192.0, "h200": 141.0}


def read_job(name: str) -> tuple[dict[str, str], list[str], str]:
    """-> (#SBATCH options, srun's trainer arguments, the script text)."""
    text = open(os.path.join(REPO, SBATCH[name])).read()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    args = shlex.split(srun)
    return options, args[args.index("zaya_jax.train") + 1:], text


def job_config(args: list[str]):
    config = load_config_file(os.path.join(REPO, args[args.index("--config") + 1]))
    for arg in args:
        if arg.startswith("--config."):
            key, _, value = arg[len("--config."):].partition("=")
            section, field = key.split(".")
            config[section][field] = type(config[section][field])(value)
    return config


@pytest.mark.parametrize("name", list(SBATCH))
def test_every_phase_fits_at_full_scale(name):
    options, args, _ = read_job(name)
    devices = int(options["nodes"]) * int(options["gpus-per-node"])
    assert devices == 1024
    config = job_config(args)
    settings = settings_from_config(config)
    cfg = model_config(config)
    phases = parse_phases(config.data, process_count=int(options["nodes"]))
    assert len(phases) == 3
    for phase in phases:
        mesh = resolve_mesh_shape(phase_mesh_sizes(config, phase), devices)
        check_batch_layout(phase.global_batch_size, phase.seq_len, settings.train.microbatches, mesh, phase.name)
        shape = StepShape(phase.global_batch_size, phase.seq_len, grad_accum=settings.train.microbatches,
                          optimizer=settings.optimizer.name,
                          shard_optimizer_over_data=settings.mesh.shard_optimizer_over_data, platform="gpu")
        result = plan(cfg, mesh, shape, MEMORY_GB[name])
        assert result["fits"], (phase.name, result["bytes_per_device"]["total"] / 1e9)


@pytest.mark.parametrize("name,case", [("mi300x", "search_pick_xla_attention"), ("h200", "search_h200_xla_attention")])
def test_job_mesh_is_the_planner_search_pick(name, case):
    """The planner's search, run here on the job's config, device count and GPU profile with the step
    shape benchmarks/planner/planner_predictions.py searches with (over every candidate mesh, as it does),
    picks the job's mesh for the whole run; and the recorded results hold that pick. The search ran
    on the XLA attention path, which the job's kernels.attention=auto runs on GPU."""
    from benchmarks.planner.planner_predictions import base_shape
    from zaya_jax.hardware import PROFILES
    from zaya_jax.planner.mesh_search import search
    from zaya_jax.planner.phase_plan import config_phases

    options, args, _ = read_job(name)
    config = job_config(args)
    assert config.kernels.attention == "auto" and config.model.attention_kernel == "auto"
    devices = int(options["nodes"]) * int(options["gpus-per-node"])
    hw = PROFILES[name]
    found = search(model_config(config), config_phases(config), base_shape(config), devices, hw, hw.memory_gb)
    assert found["whole_run"], (name, [p["infeasible"] for p in found["phases"]])
    pick = found["whole_run"][0]["mesh"]
    for phase in parse_phases(config.data):
        mesh = resolve_mesh_shape(phase_mesh_sizes(config, phase), devices)
        assert ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) == pick, \
            (name, phase.name, found["whole_run"][:3])
    recorded = json.load(open(os.path.join(REPO, "benchmarks/results/planner_predictions.json")))[case]
    assert (recorded["mesh"] if "mesh" in recorded else recorded["whole_run_top5"][0]["mesh"]) == pick, \
        "benchmarks/results/planner_predictions.json is stale: rerun python -m benchmarks.planner.planner_predictions"


def test_the_old_mesh_did_not_split_the_32k_phase():
    """data=1024 (the previous launch) cannot split phase 3's batch of 512: the check fires."""
    config = job_config(read_job("mi300x")[1])
    phase = parse_phases(config.data)[2]
    with pytest.raises(ValueError, match="does not split over mesh"):
        check_batch_layout(phase.global_batch_size, phase.seq_len, 1, resolve_mesh_shape({"data": -1}, 1024), "p3")


@pytest.mark.parametrize("name", list(SBATCH))
def test_job_resumes_and_saves_before_the_time_limit(name):
    options, args, text = read_job(name)
    assert re.fullmatch(r"TERM@\d+", options["signal"]) and int(options["signal"].split("@")[1]) >= 120
    assert "requeue" in options
    workdir = re.search(r"^WORKDIR=(.*)$", text, re.M).group(1)
    assert "SLURM_JOB_ID" not in workdir and "%j" not in workdir   # the same directory on every submission
    assert args[args.index("--workdir") + 1] == "$WORKDIR"
    # the node-local tier (docs/training.md section 5) in a directory that is the same on a requeue
    assert "--config.checkpoint.local_dir=$LOCAL_DIR" in args and "--config.checkpoint.local_every=100" in args
    local_dir = re.search(r"^LOCAL_DIR=(.*)$", text, re.M).group(1)
    assert "SLURM_JOB_ID" not in local_dir and "%j" not in local_dir


def run_local(*args: str, kfd: str) -> list[str]:
    out = subprocess.run(["bash", os.path.join(REPO, "launch/local.sh"), *args, "bash", "-c",
                          "echo C=$CUDA_VISIBLE_DEVICES R=$ROCR_VISIBLE_DEVICES H=$HIP_VISIBLE_DEVICES"],
                         capture_output=True, text=True, check=True, env={**os.environ, "ZAYA_KFD": kfd})
    return sorted(out.stdout.splitlines())


def test_local_launch_gives_each_process_its_own_gpus(tmp_path):
    assert run_local("2", "--gpus-per-process", "4", kfd=str(tmp_path / "absent")) == [
        "[0] C=0,1,2,3 R= H=", "[1] C=4,5,6,7 R= H="]
    (tmp_path / "kfd").touch()  # an AMD machine: ROCr's variable only (HIP would renumber twice)
    assert run_local("4", "--gpus-per-process", "2", kfd=str(tmp_path / "kfd")) == [
        "[0] C= R=0,1 H=", "[1] C= R=2,3 H=", "[2] C= R=4,5 H=", "[3] C= R=6,7 H="]


def test_local_launch_stops_the_job_when_a_process_fails_and_restarts_it(tmp_path):
    """A failed process ends the others at once (one waiting forever would hang the job, as a peer
    does in a collective); --restarts 1 starts the whole job once more (ZAYA_RESTART=1), which ends well."""
    launch = ["bash", os.path.join(REPO, "launch/local.sh"), "2"]
    marker = tmp_path / "failed_once"
    command = ["bash", "-c", f'echo "start $ZAYA_RESTART"; if [ $ZAYA_PROCESS_ID = 1 ] && [ ! -e {marker} ]; then '
               f'touch {marker}; exit 3; fi; [ $ZAYA_RESTART = 0 ] && exec sleep 600; echo ok']
    done = subprocess.run([*launch, *command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "a process exited with status 3; the job is stopped" in done.stderr
    marker.unlink()
    done = subprocess.run([*launch, "--restarts", "1", *command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] ok", "[0] start 0", "[0] start 1", "[1] ok", "[1] start 0",
                                                "[1] start 1"]
    assert "starts again (restart 1 of 1)" in done.stderr
    bad = subprocess.run([*launch, "--restarts", "-1", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--restarts must be a non-negative integer, got '-1'" in bad.stderr


CRASHING_PROCESS = """
from zaya_jax import cli
from zaya_jax.parallel import distributed

def main(argv):
    distributed.initialize()
    if distributed.jax.process_index() == 1:
        raise RuntimeError("process 1 crashed")
    distributed.barrier("waiting for process 1", timeout_s=600)

cli.run(main)
"""


def test_a_process_that_crashes_exits_at_once_and_the_launcher_stops_the_job():
    """An uncaught error in one process of a job (a gloo connection that timed out, a bug) prints its
    traceback and exits 1 at once (cli.exit_failed_now), while process 0 waits at a barrier for it:
    before, its exit ran jax.distributed's shutdown, which waited at a barrier process 0 never
    reached, so the job hung and launch/local.sh could neither stop nor restart it."""
    launch = ["bash", os.path.join(REPO, "launch/local.sh"), "2", "--devices-per-process", "1"]
    done = subprocess.run([*launch, sys.executable, "-c", CRASHING_PROCESS], capture_output=True, text=True,
                          timeout=90, cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[1] RuntimeError: process 1 crashed" in done.stdout
    assert "a process exited with status 1; the job is stopped" in done.stderr


# -- SLURM: the devices each task drives, the XLA flags ---------------------------------------------

SLURM_START = """
import json, jax
from zaya_jax.parallel import distributed
how = distributed.initialize()
print("TOPOLOGY", json.dumps({**distributed.topology(), "how": how,
                              "visible": jax.config.values["jax_cuda_visible_devices"]}))
"""


def _slurm_env(node: int, port: int) -> dict[str, str]:
    """What SLURM sets for the single task of node `node` of a 2-node job with 4 GPUs per node; the job
    id is chosen so that jax's SLURM detection derives `port` (job id % 4096 + 61440)."""
    return {"SLURM_JOB_ID": str(port - 61440 + 4096), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}


def test_a_slurm_task_per_node_drives_every_device_of_its_node():
    """The real start-up path under SLURM's environment (2 "nodes" x 1 task, 4 devices each): jax's own
    detection alone would have restricted each task to device SLURM_LOCALID=0."""
    import socket
    port = next(p for p in range(62000, 65000) if socket.socket().connect_ex(("127.0.0.1", p)) != 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ZAYA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4), PYTHONPATH=REPO)
    tasks = [subprocess.Popen([sys.executable, "-c", SLURM_START], cwd=REPO, env={**env, **_slurm_env(node, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(2)]
    outputs = [t.communicate(timeout=180)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    seen = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("TOPOLOGY"))[len("TOPOLOGY"):])
            for out in outputs]
    assert [s["process_index"] for s in seen] == [0, 1]
    for s in seen:
        assert s["processes"] == 2 and s["global_devices"] == 8 and s["local_devices"] == 4, s
        assert s["how"].startswith("SLURM job ") and s["visible"] == "0,1,2,3", s


@pytest.mark.parametrize("layout,expected", [
    ({"SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
    ({"SLURM_NTASKS": "256", "SLURM_JOB_NUM_NODES": "256", "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
    ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8", "SLURM_LOCALID": "5"}, [5]),
    ({"SLURM_NTASKS": "1024", "SLURM_JOB_NUM_NODES": "128", "SLURM_GPUS_ON_NODE": "8", "SLURM_LOCALID": "7"}, [7]),
    ({"SLURM_NTASKS_PER_NODE": "1"}, None),  # no GPUs allocated: a CPU job, nothing restricted
])
def test_slurm_local_device_ids_per_layout(layout, expected):
    from zaya_jax.parallel.distributed import slurm_local_device_ids
    assert slurm_local_device_ids(layout) == expected


def test_a_slurm_layout_that_is_neither_one_task_per_node_nor_per_gpu_is_named():
    from zaya_jax.config import ConfigError
    from zaya_jax.parallel.distributed import slurm_local_device_ids
    with pytest.raises(ConfigError, match=r"SLURM runs 2 tasks per node on 8 GPUs per node: run one task per node "
                                          r"\(--ntasks-per-node=1, every GPU to it\) or one per GPU "
                                          r"\(--ntasks-per-node=8\)"):
        slurm_local_device_ids({"SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"})


def gpu_xla_flags(platform: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'XLA_FLAGS= ; . launch/gpu_xla_flags.sh {platform} && echo "$XLA_FLAGS"'],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _jax_starts_with(flags: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_jobs_xla_flags_exist_in_this_jax(platform):
    """XLA parses every flag of the job at start and aborts on one it does not know (checked: a made-up
    flag fails the same start)."""
    flags = gpu_xla_flags(platform)
    assert len(flags) >= 12 and "--xla_gpu_enable_pipelined_all_gather=true" in flags
    assert ("--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true" in flags) == (platform == "rocm")
    started = _jax_starts_with(flags)
    assert started.returncode == 0, started.stderr[-2000:]
    unknown = _jax_starts_with(flags + ["--xla_gpu_enable_made_up_overlap=true"])
    assert unknown.returncode != 0 and "xla_gpu_enable_made_up_overlap" in unknown.stderr


@pytest.mark.parametrize("name", list(SBATCH))
def test_the_jobs_source_the_shared_xla_flags(name):
    _, _, text = read_job(name)
    platform = "rocm" if name == "mi300x" else "cuda"
    assert f'. "${{SLURM_SUBMIT_DIR:-.}}/launch/gpu_xla_flags.sh" {platform}' in text
    assert "XLA_FLAGS=" not in text.replace("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
