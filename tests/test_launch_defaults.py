"""The heap launch default (zaya_jax.launch_defaults): freed large blocks are reused instead of
being mapped and faulted in again, and a user's own heap settings are left alone."""

import os
import subprocess
import sys

import pytest

from zaya_jax import launch_defaults
from tests.train_helpers import REPO

# mallocs, fills and frees a 64 MB block 5 times (as XLA:CPU's buffers come and go each step),
# then prints the page faults of the last 4 rounds
ROUNDS = """
import ctypes, resource
from zaya_jax import launch_defaults
applied = launch_defaults.apply()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(5):
    if i == 1:
        start = faults()
    block = libc.malloc(64 * 2**20)
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
print(applied, faults() - start)
"""
PAGES_PER_BLOCK = 64 * 2**20 // 4096


def _faults(**env) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ZAYA_NO_LAUNCH_DEFAULTS")
               and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", ROUNDS], env={**environ, "PYTHONPATH": REPO, **env},
                          capture_output=True, text=True, check=True)
    applied, faults = done.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not launch_defaults.wanted({}), reason="the default applies to Linux with glibc only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    applied, faults = _faults()
    assert applied == "True"
    off, faults_without = _faults(ZAYA_NO_LAUNCH_DEFAULTS="1")
    assert off == "False"
    assert faults_without > 3 * PAGES_PER_BLOCK  # glibc maps each block afresh: the case happens
    assert faults < PAGES_PER_BLOCK // 10


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, {"ZAYA_NO_LAUNCH_DEFAULTS": "1"}])
def test_a_users_own_heap_settings_are_left_alone(env):
    assert not launch_defaults.wanted(env)
