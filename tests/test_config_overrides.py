"""Every ModelConfig field of every config file can be overridden from the command line."""

import glob
import json
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from zaya_jax.config import ModelConfig
from zaya_jax.config_files import load_config_file, model_config, model_section

CONFIG_FILES = sorted(glob.glob("configs/*.py"))


def parse_command_line(*args: str):
    """The config as absl + ml_collections parse `prog --config FILE --config.x=...` in the CLIs."""
    argv = ["prog", *args]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def as_flag(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_config_file_is_covered():
    assert {"configs/zaya1_base.py", "configs/zaya1_8b.py", "configs/tiny.py", "configs/bench_small.py",
            "configs/demo.py"} <= set(CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_model_section_lists_every_field(path):
    assert set(load_config_file(path).model.keys()) == set(ModelConfig.defaults())


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_model_field_takes_a_command_line_override(path):
    """All fields at once on the real flag parser (each set to the file's own value)."""
    config = load_config_file(path)
    overrides = [f"--config.model.{name}={as_flag(value)}" for name, value in config.model.items()]
    assert model_config(parse_command_line("--config", path, *overrides)) == model_config(config)


def test_overrides_change_the_model_config():
    config = parse_command_line("--config", "configs/tiny.py", "--config.model.expert_parallel=all_gather",
                                "--config.model.remat=full", "--config.model.capacity_factor=2",
                                "--config.model.scan_layers=false")
    cfg = model_config(config)
    assert (cfg.expert_parallel, cfg.remat, cfg.capacity_factor, cfg.scan_layers) == ("all_gather", "full", 2.0,
                                                                                      False)


def test_plan_cli_applies_a_model_override():
    """`--config.model.expert_parallel=all_gather` reaches the planner: no all-to-all traffic left."""
    out = subprocess.run([sys.executable, "-m", "zaya_jax.plan", "--config", "configs/tiny.py", "--json",
                          "--mesh", "data=2,expert=4", "--config.model.expert_parallel=all_gather"],
                         capture_output=True, text=True, check=True, timeout=120)
    traffic = json.loads(out.stdout)["plan"]["collective_bytes_per_step_per_device"]
    assert traffic["all_to_all"] == 0 and traffic["reduce_scatter"] > 0


def test_unknown_model_field_is_named():
    with pytest.raises(AttributeError, match="num_heads.*num_q_heads"):
        parse_command_line("--config", "configs/tiny.py", "--config.model.num_heads=4")
    with pytest.raises(ValueError, match="model.num_heads: unknown field"):
        model_section(num_heads=4)


def test_model_section_keeps_float_fields_float():
    """An int written for a float field must not make float overrides fail to parse."""
    section = model_section(rope_theta=10_000, capacity_factor=2)
    assert isinstance(section.rope_theta, float) and isinstance(section.capacity_factor, float)
    section.rope_theta = 5e5


@pytest.mark.parametrize("kernels,model,expected", [
    ({"attention": "pallas"}, {}, "pallas"),
    ({"attention": "auto"}, {"attention_kernel": "xla"}, "xla"),
    ({"attention": "pallas"}, {"attention_kernel": "pallas"}, "pallas"),
])
def test_kernels_section_and_model_field_are_one_setting(kernels, model, expected):
    config = load_config_file("configs/tiny.py")
    config.kernels.update(kernels)
    config.model.update(model)
    assert model_config(config).attention_kernel == expected


def test_conflicting_kernel_settings_name_both_fields():
    config = load_config_file("configs/tiny.py")
    config.kernels.attention, config.model.attention_kernel = "pallas", "xla"
    with pytest.raises(ValueError, match="kernels.attention='pallas' and model.attention_kernel='xla'"):
        model_config(config)
