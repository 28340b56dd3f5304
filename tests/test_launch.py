"""The shipped launch files: the MI300X job is valid in every curriculum phase, resumes, saves on
an early signal, and local.sh gives each process its own GPUs.

The planner runs on exactly the job's configuration: configs/zaya1_base.py with the overrides on
the sbatch's srun line, at nodes x GPUs per node devices, for every phase, and must fit 192 GB
(MI300X) or 141 GB (H200). The phase's batch must also pass the trainer's own layout check, and
the job's mesh must be the one `plan --search` picked for all phases on that GPU
(benchmarks/results/planner_predictions.json, written by benchmarks/planner_predictions.py).
"""

import json
import os
import re
import shlex
import subprocess

import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.data import parse_phases
from zaya_jax.parallel.mesh import phase_mesh_sizes, resolve_mesh_shape
from zaya_jax.parallel.planner import StepShape, plan
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
    """The search ran on the XLA attention path, which the job's kernels.attention=auto runs on GPU."""
    options, args, _ = read_job(name)
    config = job_config(args)
    assert config.kernels.attention == "auto" and config.model.attention_kernel == "auto"
    recorded = json.load(open(os.path.join(REPO, "benchmarks/results/planner_predictions.json")))[case]
    pick = recorded["mesh"] if "mesh" in recorded else recorded["whole_run_top5"][0]["mesh"]
    devices = int(options["nodes"]) * int(options["gpus-per-node"])
    for phase in parse_phases(config.data):
        mesh = resolve_mesh_shape(phase_mesh_sizes(config, phase), devices)
        assert ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) == pick, (name, phase.name)


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
