"""python -m zaya_jax.generate: ids, streamed text through a tokenizer.json, and --checkpoint."""

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest
import tokenizers
from absl import flags
from flax import nnx

import zaya_jax
from tests.hf_reference import make_hf_model
from zaya_jax.cli import normalize_flag_names
from zaya_jax.errors import UserError
from zaya_jax.infer import QuantizedArray, generate_static
from zaya_jax.model.params import BalancingBias

cli = importlib.import_module("zaya_jax.generate")  # the CLI module
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(args: list[str]) -> None:
    """Sets the CLI's flags as `python -m zaya_jax.generate ARGS` would."""
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["generate", *normalize_flag_names(args)])


def run_main(args: list[str]) -> None:
    parse(args)
    cli.main(["generate"])


def expected_ids(model, prompt: list[int], new: int) -> list[int]:
    """What the CLI should print: generate with eos ignored (through the same compiled streaming loop)."""
    return generate_static(model, [prompt], new, stop_at_eos=False, on_token=lambda *_: None)[0].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "hf"
    make_hf_model(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A word-level tokenizer.json: token i is the word 'w<i>' (vocab 97, as the tiny model)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.torch_reference
def test_prompt_ids_print_the_generated_ids(checkpoint, capsys):
    run_main(["--hf", str(checkpoint), "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos"])
    printed = [int(x) for x in capsys.readouterr().out.split()]
    assert printed == expected_ids(zaya_jax.load_hf(checkpoint), [5, 6, 7], 6)


@pytest.mark.torch_reference
def test_module_streams_text_with_a_tokenizer(checkpoint, tokenizer_file):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    args = ["--hf", str(checkpoint), "--tokenizer", str(tokenizer_file), "--prompt", "w5 w6 w7",
            "--max-new-tokens", "6", "--ignore-eos"]
    run = subprocess.run([sys.executable, "-m", "zaya_jax.generate", *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr
    words = run.stdout.split()
    assert len(words) == 6 and all(w.startswith("w") for w in words), run.stdout
    model = zaya_jax.load_hf(checkpoint)
    assert words == [f"w{i}" for i in expected_ids(model, [model.config.bos_token_id, 5, 6, 7], 6)]
    assert "tokens in" in run.stderr


@pytest.mark.torch_reference
def test_checkpoint_reads_a_training_checkpoint(checkpoint, tmp_path, capsys):
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    model = zaya_jax.load_hf(checkpoint)
    _, params, biases = nnx.split(model, nnx.Param, BalancingBias)
    save_model(str(tmp_path / "run"), nnx.to_pure_dict(params),
               nnx.to_pure_dict(biases)["layers"]["moe"]["router"]["balancing_biases"],
               {"model": dataclasses.asdict(model.config)})
    run_main(["--checkpoint", str(tmp_path / "run"), "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
              "--ignore-eos"])
    printed = [int(x) for x in capsys.readouterr().out.split()]
    assert printed == expected_ids(model, [5, 6, 7], 6)


@pytest.mark.torch_reference
def test_quantize_and_dtype_options_reach_the_loader(checkpoint):
    parse(["--hf", str(checkpoint), "--prompt-ids", "5", "--quantize", "int4", "--group-size", "8",
           "--dtype", "bfloat16"])
    model = cli.load_model()
    assert model.config.dtype == "bfloat16"
    gate = model.layers.moe.gate.get_value()
    assert isinstance(gate, QuantizedArray) and gate.bits == 4 and gate.scales.shape[-2] == 32 // 8


@pytest.mark.torch_reference
def test_a_checkpoint_loads_without_the_trainer(checkpoint, tmp_path, monkeypatch):
    """The checkpoint reader is its own layer (zaya_jax.checkpoints): loading a run's checkpoint
    for generation imports nothing of zaya_jax.train."""
    from zaya_jax.checkpoints.model_parts import ModelParts
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    model = zaya_jax.load_hf(str(checkpoint))
    save_model(str(tmp_path / "run"), *ModelParts.arrays(model), {"model": dataclasses.asdict(model.config)})
    monkeypatch.setitem(sys.modules, "zaya_jax.train", None)  # as if zaya_jax.train were not installed
    parse(["--checkpoint", str(tmp_path / "run"), "--prompt-ids", "5", "--max-new-tokens", "2"])
    assert cli.load_model().config == model.config


@pytest.mark.torch_reference
def test_prompt_text_needs_a_tokenizer(checkpoint):
    with pytest.raises(UserError, match=f"--hf {checkpoint} holds no tokenizer.json: pass --tokenizer FILE"):
        run_main(["--hf", str(checkpoint), "--prompt", "hello"])
