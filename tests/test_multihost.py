"""A real 2-process x 4-device job computes the same losses as 1 process with 8 devices."""

import json
import os
import subprocess
import sys

import pytest

from tests.fake_devices import compile_flags, xla_flags
from tests.train_helpers import GLOO_CONNECT_FAILURE, RERUN_IF_OVERLOADED, OverloadedHarness
from zaya_jax.parallel import distributed

CHECK = [sys.executable, "-m", "zaya_jax.parallel.check", "--config", "configs/tiny.py", "--batches", "2"]


def _losses(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    if out.returncode != 0 and GLOO_CONNECT_FAILURE in out.stdout + out.stderr:
        raise OverloadedHarness(GLOO_CONNECT_FAILURE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if '"losses"' in ln)
    return json.loads(line[line.index("{"):])


# Multi-process jobs share one xdist worker (--dist loadgroup): two of them at once on 2 cores can
# leave a process past gloo's fixed 30 s wait for its peers at a first collective.
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.flaky(**RERUN_IF_OVERLOADED)
def test_two_processes_match_one():
    single = _losses(CHECK + ["--mesh", "data=8"], {"XLA_FLAGS": xla_flags(8)})
    multi = _losses(["launch/local.sh", "2", "--devices-per-process", "4"] + CHECK + ["--mesh", "data=2,fsdp=4"],
                    {"XLA_FLAGS": compile_flags()})
    assert multi["processes"] == 2 and multi["global_devices"] == 8 and multi["local_devices"] == 4
    assert single["processes"] == 1
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_partial_multiprocess_environment_is_named():
    with pytest.raises(ValueError, match=r"missing process_id \(ZAYA_PROCESS_ID\)"):
        distributed.initialize(env={"ZAYA_COORDINATOR": "127.0.0.1:1", "ZAYA_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="ZAYA_NUM_PROCESSES='two' must be an integer"):
        distributed.initialize(env={"ZAYA_NUM_PROCESSES": "two"})
