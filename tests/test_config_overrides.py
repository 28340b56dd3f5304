"""Every ModelConfig field of every config file can be overridden from the command line."""

import glob
import json
import subprocess
import sys
import warnings

import pytest
from absl import flags
from ml_collections import config_flags

from zaya_jax.config import (COMPUTE_DTYPES, EXPERT_PARALLEL, KERNELS, LAYOUTS, MATMUL_PRECISIONS, MOE_BACKENDS,
                             REMAT_POLICIES, ROPE_SCALING_FIELDS, ModelConfig, RopeScaling)
from zaya_jax.config_files import load_config_file, model_config, model_section

CONFIG_FILES = sorted(glob.glob("configs/*.py"))


def parse_command_line(*args: str):
    """The config as absl + ml_collections parse `prog --config FILE --config.x=...` in the CLIs."""
    argv = ["prog", *args]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    with warnings.catch_warnings():
        # ml_collections 1.1.0 (the latest) loads the file with SourceFileLoader.load_module(),
        # deprecated since Python 3.10, on every parse (226 warnings in this file) and takes no other
        # loader. The CLIs parse under Python's default filters, which hide it; load_config_file
        # loads with exec_module.
        warnings.filterwarnings("ignore", r"the load_module\(\) method is deprecated", DeprecationWarning)
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


def different_value(name: str, cfg: ModelConfig):
    """A valid value of field `name` that differs from cfg's."""
    value = getattr(cfg, name)
    choices = {"layout": LAYOUTS, "dtype": COMPUTE_DTYPES, "moe_backend": MOE_BACKENDS, "remat": REMAT_POLICIES,
               "attention_kernel": KERNELS, "moe_matmul_kernel": KERNELS, "expert_parallel": EXPERT_PARALLEL,
               "matmul_precision": MATMUL_PRECISIONS}
    if name in choices:
        return next(c for c in choices[name] if c != value)
    if isinstance(value, bool):
        return not value
    if name == "partial_rotary_factor":
        return 1.0 if value != 1.0 else 0.5
    if name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        return (value + 3) % cfg.vocab_size
    if name == "layer_types":  # needs a window (COMPANIONS)
        return ("hybrid_sliding",) + ("hybrid",) * (cfg.num_layers - 1)
    if name in ROPE_SCALING_FIELDS:  # set key by key (as_flags): rope_type and the key it reads
        return RopeScaling(rope_type="linear", factor=2.5) if value.rope_type != "linear" else RopeScaling()
    if name == "num_kv_heads":  # stays even and divides the query heads
        return next(k for k in range(2, cfg.num_q_heads + 1, 2) if k != value and cfg.num_q_heads % k == 0)
    if isinstance(value, float) or name in ("num_q_heads", "head_dim"):  # doubling keeps the head rules
        return value * 2
    return value + 1


COMPANIONS = {"layer_types": {"sliding_window": 8},
              "matmul_precision": {"moe_backend": "ragged", "moe_matmul_kernel": "xla"}}  # fields a valid new value needs set with it


def as_flags(field: str, value) -> list[str]:
    """--config.model.<field>=<value>; a RopeScaling as one flag per key (its section's keys)."""
    if isinstance(value, RopeScaling):
        return [f"--config.model.{field}.{key}={as_flag(v)}" for key, v in vars(value).items()
                if key not in ("short_factor", "long_factor")]
    return [f"--config.model.{field}={as_flag(value)}"]


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_model_field_override_changes_that_field_only(path):
    """Each field set on the real flag parser to a value different from the file's own."""
    config = load_config_file(path)
    before = model_config(config)
    for name in ModelConfig.defaults():
        new = different_value(name, before)
        assert new != getattr(before, name)
        changes = {name: new, **COMPANIONS.get(name, {})}
        after = model_config(parse_command_line("--config", path, *(flag for field, value in changes.items()
                                                                    for flag in as_flags(field, value))))
        assert after == before.replace(**changes), name


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_kernel_section_overrides_change_the_model_config(path):
    after = model_config(parse_command_line("--config", path, "--config.kernels.attention=pallas",
                                            "--config.kernels.moe_matmul=pallas"))
    assert model_config(load_config_file(path)).attention_kernel == "auto"
    assert (after.attention_kernel, after.moe_matmul_kernel) == ("pallas", "pallas")


def test_overrides_change_the_model_config():
    config = parse_command_line("--config", "configs/tiny.py", "--config.model.expert_parallel=all_gather",
                                "--config.model.remat=full", "--config.model.capacity_factor=2",
                                "--config.model.scan_layers=false")
    cfg = model_config(config)
    assert (cfg.expert_parallel, cfg.remat, cfg.capacity_factor, cfg.scan_layers) == ("all_gather", "full", 2.0,
                                                                                      False)


def test_plan_cli_applies_a_model_override():
    """`--config.model.expert_parallel=all_gather` reaches the planner: no all-to-all traffic left."""
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", "configs/tiny.py", "--json",
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


def test_a_rope_scaling_is_set_key_by_key_from_the_command_line():
    """A scaling's keys, the longrope factor lists included, from flags; the file gives none."""
    config = parse_command_line("--config", "configs/tiny.py", "--config.model.rope_scaling.rope_type=longrope",
                                "--config.model.rope_scaling.short_factor=(1.0, 1.5, 2.0, 3.0)",
                                "--config.model.rope_scaling.long_factor=(1, 2, 4, 8)",
                                "--config.model.rope_scaling.original_max_position_embeddings=256")
    assert model_config(config).rope_scaling == RopeScaling(
        rope_type="longrope", short_factor=(1.0, 1.5, 2.0, 3.0), long_factor=(1.0, 2.0, 4.0, 8.0),
        original_max_position_embeddings=256)
