"""The suite's processes compile as docs/testing.md says. Where jaxlib < 0.11 (the Python 3.11 stack)
they use XLA:CPU's legacy loop emitters (--xla_cpu_use_fusion_emitters=false: cold compiles in 0.62
of the time), in the pytest workers and in every subprocess they start; where jaxlib >= 0.11 the flag
is absent (that XLA refuses it). Both use LLVM at -O0. Dropping a flag changes no result, only CI's
time, so without this check nothing would fail. The jaxlib version is read from jaxlib itself, not
through tests/fake_devices.has_legacy_emitters, the code under test."""

import os

import jaxlib

from tests.fake_devices import compile_flags
from tests.train_helpers import cli_env

LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
LLVM_O0 = "--xla_backend_optimization_level=0"
HAS_LEGACY_EMITTERS = tuple(int(part) for part in jaxlib.__version__.split(".")[:2]) < (0, 11)


def _compiles_as_the_suite_does(xla_flags: str) -> None:
    flags = xla_flags.split()
    assert (LEGACY_EMITTERS in flags) == HAS_LEGACY_EMITTERS, (jaxlib.__version__, xla_flags)
    assert LLVM_O0 in flags, xla_flags


def test_the_pytest_workers_compile_with_the_suites_flags():
    _compiles_as_the_suite_does(os.environ["XLA_FLAGS"])


def test_cli_and_multiprocess_subprocesses_compile_with_the_suites_flags():
    _compiles_as_the_suite_does(cli_env()["XLA_FLAGS"])
    _compiles_as_the_suite_does(compile_flags())  # launch/local.sh's processes (tests/test_multihost.py)
