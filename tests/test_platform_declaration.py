"""A config that declares a platform refuses to start on another, naming the install command."""

import os

import pytest

from pallas_kernels import building_for
from zaya_jax.config_files import load_config_file
from zaya_jax.errors import UserError
from zaya_jax.parallel.mesh import PlatformMismatchError, check_declared_platform
from zaya_jax.train.loop import Trainer


def test_gpu_config_on_a_cpu_jax_stops_before_anything_is_built(tmp_path):
    config = load_config_file("configs/tiny.py")
    config.mesh.platform = "gpu"
    with pytest.raises(UserError, match=r"mesh.platform='gpu' but jax runs on cpu .*pip install -e '\.\[cuda\]'"):
        Trainer(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_declared_platform_matches():
    check_declared_platform("any")
    check_declared_platform("cpu")
    with building_for("rocm"):
        check_declared_platform("gpu")
        check_declared_platform("rocm")
        with pytest.raises(PlatformMismatchError, match=r"runs on rocm.*pip install -e '\.\[cuda\]'"):
            check_declared_platform("cuda")


def test_unknown_platform_is_named():
    from zaya_jax.train.settings import settings_from_config
    config = load_config_file("configs/tiny.py")
    config.mesh.platform = "metal"
    with pytest.raises(ValueError, match="mesh.platform='metal' does not exist"):
        settings_from_config(config)
