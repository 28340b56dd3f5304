"""Every entry point, run as a user runs it: a mistake ends in one or two `error:` lines naming the
input and the fix, exit code 2, no traceback (unless --debug) and nothing created; --help exits 0."""

import dataclasses
import os
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, cli_env, run_train
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import save_model
from zaya_jax.checkpoints.model_parts import ModelParts

TINY = os.path.join(REPO, "configs", "tiny.py")
ENTRY_POINTS = ("zaya_jax.train", "zaya_jax.planner", "zaya_jax.generate", "zaya_jax.evaluate", "zaya_jax.convert",
                "zaya_jax.data.prepare", "zaya_jax.data.train_tokenizer", "zaya_jax.data.demo_corpus")


def cli(module, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines[0].startswith("error: ") and len(lines) <= 2, done.stderr[-3000:]
    for fragment in fragments:
        assert fragment in done.stderr, (fragment, done.stderr)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_exits_zero_and_shows_the_usage(module):
    done = cli(module, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"python -m {module}" in done.stdout and "--[no]debug" in done.stdout


@pytest.mark.parametrize("args,fragments", [
    (("--config", "configs/nope.py"), ("--config configs/nope.py: no such config file",)),
    (("--config", TINY, "--config.train.stepz=1"),
     ("--config.train.stepz", "no field 'stepz'", "did you mean 'steps'")),
    (("--config", TINY, "--config.train.steps=abc"), ("--config.train.steps=abc: train.steps takes an integer, "
                                                      "not 'abc'",)),
    (("--config", TINY, "--config.optimizer.min_lr_ratio=low"), ("optimizer.min_lr_ratio takes a number, not 'low'",)),
    (("--config", TINY, "--config.monitor.progress_bar=maybe"), ("monitor.progress_bar takes true or false",)),
    (("--config", TINY, "--config.mesh.data=3"), ("mesh:", "!= 8 devices", "--config.mesh.data=-1")),
    (("--config", TINY, "--config.mesh.data=1", "--config.mesh.tensor=8"),
     ("error: mesh: tensor=8 does not divide qk_heads = 6", "so tensor must be 1 or 2", "fix: --config.mesh.tensor=2")),
    (("--config", TINY, "--config.train.steps=5"), ("optimizer.warmup_steps (10) must be below train.steps (5)",
                                                    "--config.optimizer.warmup_steps")),
    (("--config", TINY, "--config.model.matmul_precision=fp8_e4m3"),
     ("model.matmul_precision='fp8_e4m3' does not exist", "'fp8', 'fp8_gpu', 'fp8_nanoo'")),
    (("--config", TINY, "--config.model.matmul_precision=fp8", "--config.model.moe_backend=native"),
     ("model.matmul_precision='fp8' runs the experts as FP8 ragged_dot", "model.moe_backend to 'auto' or 'ragged'")),
    (("--config.train.steps=50",), ("--config.train.steps=50: overrides a field of a config file, but no --config "
                                    "was given", "add --config FILE, e.g. --config configs/demo.py")),
])
def test_train_config_mistakes(tmp_path, args, fragments):
    assert_user_error(cli("zaya_jax.train", *args, "--workdir", tmp_path / "run"), *fragments)
    assert not (tmp_path / "run").exists()


def test_a_config_file_with_a_syntax_error_is_named_with_its_line_and_column(tmp_path):
    config = tmp_path / "broken.py"
    config.write_text("def get_config():\n    return dict(model=1,,)\n")
    assert_user_error(cli("zaya_jax.train", "--config", config, "--workdir", tmp_path / "run"),
                      f"--config {config}: Python syntax error at line 2, column 25: invalid syntax")
    assert not (tmp_path / "run").exists()


def test_the_harness_without_the_eval_extra_names_the_install(tmp_path):
    without_lm_eval = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv[0] = 'zaya_jax.harness'; "
                       "runpy.run_module('zaya_jax.harness', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", without_lm_eval, "--checkpoint", str(tmp_path), "--tasks", "zaya_demo"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert_user_error(done, "python -m zaya_jax.harness needs lm-evaluation-harness", 'pip install -e ".[eval]"')


def test_train_workdir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    assert_user_error(cli("zaya_jax.train", "--config", TINY, "--workdir", tmp_path / "file"),
                      "is a file, not a directory")


def test_train_workdir_that_cannot_be_created(tmp_path):
    assert_user_error(cli("zaya_jax.train", "--config", TINY, "--workdir", "/proc/zaya_run"),
                      "workdir /proc/zaya_run cannot be created", "choose another --workdir")
    (tmp_path / "read_only").mkdir(mode=0o555)
    done = run_train(tmp_path / "read_only" / "run", unprivileged=True)  # file modes bind it, even as root
    assert_user_error(done, f"workdir {tmp_path / 'read_only' / 'run'} cannot be created: Permission denied")


def test_a_cache_variable_naming_a_file_is_named_and_leaves_no_workdir(tmp_path):
    (tmp_path / "cache").write_text("")
    done = subprocess.run([sys.executable, "-m", "zaya_jax.train", "--config", TINY, "--workdir", str(tmp_path / "run")],
                          cwd=REPO, env={**cli_env(), "ZAYA_JAX_CACHE": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=300)
    assert_user_error(done, f"ZAYA_JAX_CACHE={tmp_path / 'cache'}: is a file, not a directory")
    assert not (tmp_path / "run").exists()  # no workdir, so no .lock left behind


def test_debug_shows_the_traceback(tmp_path):
    done = cli("zaya_jax.train", "--config", TINY, "--config.train.steps=5", "--workdir", tmp_path / "run", "--debug")
    assert done.returncode != 0 and "Traceback" in done.stderr and "ConfigError" in done.stderr


@pytest.mark.parametrize("module,args", [
    ("zaya_jax.generate", ("--prompt_ids", "2,5")),
    ("zaya_jax.evaluate", ()),
    ("zaya_jax.convert", ("to_hf", "--out", "OUT")),
])
def test_a_missing_checkpoint_is_named_and_never_created(tmp_path, module, args):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert_user_error(cli(module, "--checkpoint", tmp_path / "nope", *args), f"no checkpoint at {tmp_path / 'nope'}")
    assert not (tmp_path / "nope").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("module,args", [("zaya_jax.generate", ("--prompt_ids", "2,5")), ("zaya_jax.evaluate", ())])
def test_mxfp4_block_axis_without_hf_is_refused(tmp_path, module, args):
    """--mxfp4_block_axis says how to read an MXFP4 HF directory: with --checkpoint it is refused, not ignored."""
    assert_user_error(cli(module, "--checkpoint", tmp_path, "--mxfp4_block_axis", "input", *args),
                      "--mxfp4_block_axis input: goes with --hf (an MXFP4 HF checkpoint); drop it")


def test_evaluate_of_a_model_only_checkpoint_asks_for_a_config(tmp_path):
    cfg = model_config(load_config_file(TINY))
    params, biases = ModelParts.arrays(create_model(cfg, seed=0))
    save_model(str(tmp_path / "orbax"), params, biases, {"model": dataclasses.asdict(cfg)})  # as convert to_orbax
    done = cli("zaya_jax.evaluate", "--checkpoint", tmp_path / "orbax")
    assert_user_error(done, "model-only checkpoint", "--config configs/demo.py")
    assert "type_handler_registry" not in done.stderr and " INFO " not in done.stderr  # library logs quiet


def test_an_hf_directory_given_as_checkpoint_is_pointed_to_hf(tmp_path):
    cfg = model_config(load_config_file(TINY))
    import zaya_jax
    zaya_jax.save_hf(create_model(cfg.replace(layout="native", router_norm_eps=cfg.rms_norm_eps,
                                              residual_in_fp32=True), seed=0), tmp_path / "hf")
    for module in ("zaya_jax.evaluate", "zaya_jax.generate"):
        assert_user_error(cli(module, "--checkpoint", tmp_path / "hf", "--prompt_ids", "2,5")
                          if module == "zaya_jax.generate" else cli(module, "--checkpoint", tmp_path / "hf"),
                          "no step directories (it holds an HF checkpoint's config.json: give it as --hf instead)")


def test_generate_names_a_quantization_group_the_weights_do_not_split_into(tmp_path):
    cfg = model_config(load_config_file(TINY))
    import zaya_jax
    zaya_jax.save_hf(create_model(cfg.replace(layout="native", router_norm_eps=cfg.rms_norm_eps,
                                              residual_in_fp32=True), seed=0), tmp_path / "hf")
    done = cli("zaya_jax.generate", "--hf", tmp_path / "hf", "--prompt_ids", "2,5", "--quantize", "int4",
               "--group_size", "24")
    assert_user_error(done, "does not split into groups of 24",
                      "choose a group_size (generate's --group_size) that divides it")


def test_plan_accepts_the_spelling_its_help_shows(tmp_path):
    for flag in ("--device_memory_gb", "--device-memory-gb"):
        done = cli("zaya_jax.planner", "--config", "configs/tiny.py", "--mesh", "data=8", flag, "80")
        assert done.returncode == 0 and "fits in 80 GB" in done.stdout, done.stderr[-3000:]


def test_generate_names_a_bad_hf_directory_and_a_bad_tokenizer(tmp_path):
    assert_user_error(cli("zaya_jax.generate", "--hf", tmp_path, "--prompt-ids", "2,5"),
                      f"{tmp_path / 'config.json'}: missing")
    assert_user_error(cli("zaya_jax.generate", "--hf", tmp_path, "--prompt", "hi", "--tokenizer", tmp_path / "t.json"),
                      f"--tokenizer {tmp_path / 't.json'}: cannot read it")


@pytest.fixture(scope="module")
def quantized_exports(tmp_path_factory):
    """configs/tiny.py's model (native, random) written by save_hf as fp8 (16 x 16 blocks) and mxfp4."""
    import zaya_jax
    cfg = model_config(load_config_file(TINY))
    model = create_model(cfg.replace(layout="native", router_norm_eps=cfg.rms_norm_eps, residual_in_fp32=True), seed=0)
    root = tmp_path_factory.mktemp("quantized")
    for method in ("fp8", "mxfp4"):
        zaya_jax.save_hf(model, root / method, quantize=method, block=16)
    return root


def broken(exports, tmp_path, method: str, config_change: dict, rewrite=lambda name, tensor: None):
    import json

    from tests.quantized_fixtures import requantize
    config = json.loads((exports / method / "config.json").read_text())["quantization_config"]
    return requantize(exports / method, tmp_path / "broken", {**config, **config_change}, rewrite)


@pytest.mark.parametrize("case", ["unknown method", "missing scales", "scale grid of another block", "mxfp4 shape"])
def test_generate_names_what_is_wrong_with_a_quantized_checkpoint(quantized_exports, tmp_path, case):
    o_proj, down = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.down_proj"
    if case == "unknown method":
        directory, fragments = broken(quantized_exports, tmp_path, "fp8", {"quant_method": "awq"}), (
            "quantization_config.quant_method='awq' is not read here", "'fp8'", "'mxfp4'", "dequantize=True")
    elif case == "missing scales":
        directory = broken(quantized_exports, tmp_path, "fp8", {},
                           lambda name, tensor: {} if name == o_proj + "_scale_inv" else None)
        fragments = ("missing scales", f"tensor {o_proj!r} is float8_e4m3fn", f"{o_proj + '_scale_inv'!r}")
    elif case == "scale grid of another block":
        directory = broken(quantized_exports, tmp_path, "fp8", {"weight_block_size": [24, 24]})
        fragments = ("_scale_inv' has shape (", "one scale per 24x24 block of", "(the last block of an axis partial)",
                     "quantization_config.weight_block_size")
    else:
        directory = broken(quantized_exports, tmp_path, "mxfp4", {}, lambda name, tensor: {
            name: tensor.reshape(tensor.shape[0], -1, 32, 16)} if name == down + "_blocks" else None)
        fragments = (f"mxfp4 tensor {down + '_blocks'!r} has shape (4, 4, 32, 16), expected (4, 64, 2, 16)",)
    assert_user_error(cli("zaya_jax.generate", "--hf", directory, "--prompt_ids", "2,5"), *fragments)


def test_a_quantized_export_that_would_quantize_no_tensor_is_refused(tmp_path):
    """mxfp4 blocks 32 values of the experts' output axis: a model whose gate_up [E, 48, 48] and down
    [E, 48, 24] have none leaves nothing to quantize; the export is refused, nothing written."""
    cfg = model_config(load_config_file(TINY))
    cfg = cfg.replace(layout="native", router_norm_eps=cfg.rms_norm_eps, residual_in_fp32=True, hidden_size=48,
                      moe_intermediate_size=24)
    params, biases = ModelParts.arrays(create_model(cfg, seed=0))
    save_model(str(tmp_path / "ckpt"), params, biases, {"model": dataclasses.asdict(cfg)})
    done = cli("zaya_jax.convert", "to_hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf",
               "--quantize", "mxfp4")
    assert_user_error(done, "--quantize mxfp4: no tensor of this model would be quantized",
                      "(4, 48, 24), (4, 48, 48)", "export it in float (no --quantize) or with --quantize fp8")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))
