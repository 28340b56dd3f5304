"""After a curriculum: the checkpoint rebuilds the model of its last phase for generate, evaluate and
convert with no extra flags, and `--config.train.steps=N` alone trains the finished run on.

One run of the demo config (a 2-layer width-64 model, a 40-document demo corpus, each phase one or
two batches) through its three phases: the last trains at rope_theta 1e5, the config's model
section says 1e4.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, cli_env, run_train, train_losses
from zaya_jax.train.checkpoint import checkpoint_dir, load_checkpoint_model, read_config
from zaya_jax.train.monitor import read_metrics

SMALL_DEMO = ("--config.model.hidden_size=64", "--config.model.num_layers=2", "--config.model.head_dim=16",
              "--config.model.moe_intermediate_size=64", "--config.model.router_hidden_size=16",
              "--config.model.num_experts=4", "--config.data.demo.max_docs=40", "--config.data.eval.max_batches=1",
              "--config.data.phases[0].token_budget=2048", "--config.data.phases[1].token_budget=1024",
              "--config.data.phases[2].token_budget=2048", "--config.train.steps=4", "--config.train.log_every_steps=1",
              "--config.optimizer.warmup_steps=1", "--config.checkpoint.every_steps=0", "--config.eval.every_steps=0",
              "--config.monitor.heatmap_every_steps=0")


def cli(module, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    done = run_train(root / "run", *SMALL_DEMO, f"--config.data.demo.cache_dir={root / 'corpus'}",
                     config="configs/demo.py")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run", done.stdout + done.stderr


def test_every_phase_is_announced_and_the_run_ends_with_a_summary(demo_run):
    workdir, log = demo_run
    for number, name, theta in ((1, "prose_heavy", "10000"), (2, "code_math_heavy", "10000"),
                                (3, "long_mixed", "100000")):
        assert re.search(rf"phase {number}/3 '{name}' \(batch 8 x seq_len \d+, rope_theta {theta}\)", log), log
    assert "seq_len 256, rope_theta 100000); compiling the step for it" in log
    assert "seq_len 128, rope_theta 10000)\n" in log  # phase 2 reuses phase 1's compiled step
    assert f"finished at step 4, loss {read_metrics(str(workdir / 'metrics.jsonl'))[-1]['loss']:.4f}" in log
    for output in ("checkpoints", "metrics.jsonl", "tensorboard", "expert_load.png"):
        assert str(workdir / output) in log, output


def test_checkpoint_rebuilds_the_last_phase_model(demo_run):
    workdir, _ = demo_run
    config = read_config(checkpoint_dir(str(workdir)))
    assert config.data.phases[2]["rope_theta"] == 1e5 and config.data.phases[0]["rope_theta"] == 1e4
    assert config.model.rope_theta == 1e5  # the demo file says 1e4; the step was trained at 1e5
    model, step = load_checkpoint_model(str(workdir))
    assert step == 4 and model.config.rope_theta == 1e5 and model.config.layout == "native"


def test_generate_from_the_checkpoint_needs_no_tokenizer_flag(demo_run):
    workdir, _ = demo_run
    done = cli("zaya_jax.generate", "--checkpoint", workdir, "--prompt", "ROMEO:", "--max_new_tokens", 4,
               "--ignore_eos")
    assert done.returncode == 0, done.stderr[-3000:]
    corpus_tokenizer = next((workdir.parent / "corpus").glob("*/tokenizer.json"))
    assert f"[tokenizer: {corpus_tokenizer}, the run's data.tokenizer 'demo:tokenizer']" in done.stderr
    assert "4 tokens in" in done.stderr


@pytest.fixture(scope="module")
def demo_export(demo_run, tmp_path_factory):
    """`convert to_hf` of the demo run: (its directory, the command's stderr)."""
    workdir, _ = demo_run
    out = tmp_path_factory.mktemp("export") / "hf"
    exported = cli("zaya_jax.convert", "to_hf", "--checkpoint", workdir, "--out", out)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return out, exported.stderr


def test_evaluate_and_convert_use_the_phase_rope_theta(demo_run, demo_export):
    workdir, _ = demo_run
    scored = cli("zaya_jax.evaluate", "--checkpoint", workdir)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert json.loads(scored.stdout)["rope_theta"] == 1e5
    hf_config = json.loads((demo_export[0] / "config.json").read_text())
    assert hf_config["rope_parameters"]["hybrid"]["rope_theta"] == 1e5
    # the export, scored with the config the run used (whose model section says 1e4), is the same model
    on_hf = cli("zaya_jax.evaluate", "--hf", demo_export[0], "--config", "configs/demo.py", *SMALL_DEMO,
                f"--config.data.demo.cache_dir={workdir.parent / 'corpus'}")
    assert on_hf.returncode == 0, on_hf.stderr[-3000:]
    assert json.loads(on_hf.stdout)["rope_theta"] == 1e5
    losses = [{source: r["loss"] for source, r in json.loads(done.stdout)["results"].items()} for done in (on_hf, scored)]
    # the same fp32 weights through the same program: equal to 1e-7 (measured: bit-identical), where the
    # wrong RoPE base (1e4) moves a loss by 2e-5 relative; a 1e-5 tolerance left that margin thin
    assert losses[0] == pytest.approx(losses[1], rel=1e-7) and len(losses[0]) == 3


def test_convert_says_what_its_read_back_check_found(demo_export):
    line = next(ln for ln in demo_export[1].splitlines() if ln.startswith("checked:"))
    found = re.fullmatch(r"checked: the native export read back gives every architecture field and the source's "
                         r"logits on a 2 x 24 probe batch \(max difference (\S+), logits up to (\S+), tolerance "
                         r"1e-05 of the scale\)", line)
    assert found and float(found[1]) <= 1e-5 * float(found[2]) and float(found[2]) > 0, line


def test_the_exported_tokenizer_puts_bos_first_as_training_did(demo_run, demo_export):
    import tokenizers
    workdir, _ = demo_run
    trained = tokenizers.Tokenizer.from_file(str(next((workdir.parent / "corpus").glob("*/tokenizer.json"))))
    exported = tokenizers.Tokenizer.from_file(str(demo_export[0] / "tokenizer.json"))
    bos = read_config(checkpoint_dir(str(workdir))).model.bos_token_id
    text = "ROMEO: hello"
    assert trained.encode(text).ids[:1] != [bos]  # the run's file adds nothing: the loader puts bos first
    assert exported.encode(text).ids == [bos] + trained.encode(text).ids
    assert exported.encode(text, add_special_tokens=False).ids == trained.encode(text).ids  # apply_chat_template's


def test_generate_reads_the_exports_tokenizer_and_a_given_step(demo_run, demo_export):
    workdir, _ = demo_run
    args = ("--prompt", "ROMEO:", "--max_new_tokens", 6, "--ignore_eos")
    on_hf = cli("zaya_jax.generate", "--hf", demo_export[0], *args)
    assert on_hf.returncode == 0, on_hf.stderr[-3000:]
    assert f"[tokenizer: {demo_export[0] / 'tokenizer.json'}]" in on_hf.stderr
    at_step = cli("zaya_jax.generate", "--checkpoint", workdir, "--step", 4, *args)
    assert at_step.returncode == 0, at_step.stderr[-3000:]
    assert on_hf.stdout == at_step.stdout  # one model, one prompt (bos first), greedy
    assert "6 tokens in" in on_hf.stderr and "6 tokens in" in at_step.stderr
    missing = cli("zaya_jax.generate", "--checkpoint", workdir, "--step", 3, *args)
    assert missing.returncode == 2 and "(step 3): step 3: no such step directory (saved steps: 4)" in missing.stderr
    step_dir = cli("zaya_jax.generate", "--checkpoint", workdir / "checkpoints" / "4", *args)
    assert step_dir.returncode == 2, step_dir.stderr[-2000:]
    assert f"(it is a step directory: give --checkpoint {workdir / 'checkpoints'} --step 4)" in step_dir.stderr
    workdir_as_hf = cli("zaya_jax.generate", "--hf", workdir, *args)
    assert workdir_as_hf.returncode == 2 and "Traceback" not in workdir_as_hf.stderr, workdir_as_hf.stderr[-2000:]
    assert f"is a zaya_jax run or checkpoint directory, not an HF export: give it as --checkpoint {workdir}" \
        in workdir_as_hf.stderr and "--tokenizer" not in workdir_as_hf.stderr


@pytest.mark.parametrize("args,message", [
    (("--prompt_ids", "2,99999"), "error: --prompt_ids: 99999 outside the model's vocabulary (ids 0..4095)"),
    (("--prompt_ids", "2,5", "--max_new_tokens", "5000"),
     "error: --max_new_tokens 5000: with the 2-token prompt that is 5002 positions, past the model's "
     "max_position_embeddings 1024; ask for at most 1022"),
    (("--prompt_ids", ",".join(["5"] * 1030)),
     "error: the prompt is 1030 tokens, 7 too many: the model's max_position_embeddings 1024 leaves room for a "
     "prompt of at most 1023 and one new token; shorten it"),
])
def test_generate_names_a_prompt_the_model_cannot_take(demo_run, args, message):
    done = cli("zaya_jax.generate", "--checkpoint", demo_run[0], *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_train_steps_alone_extends_a_finished_run_in_its_last_phase(demo_run, tmp_path):
    """Also the bar of a resumed run: it starts at the restored step, and its rate counts this
    session's steps after the first (which compiles), so its ETA is the steps' own."""
    workdir, _ = demo_run
    shutil.copytree(workdir, tmp_path / "run")
    corpus = workdir.parent / "corpus"
    steps = [a for a in SMALL_DEMO if not a.startswith("--config.train.steps")]
    done = run_train(tmp_path / "run", *steps, "--config.train.steps=7", f"--config.data.demo.cache_dir={corpus}",
                     "--config.monitor.progress_bar=True", config="configs/demo.py")
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "start at step 4: restored checkpoint 4" in log and "data exhausted" not in log
    assert "train.steps=7 is 3 batches past the curriculum: its last phase 'long_mixed' continues" in log
    records = {r["step"]: r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))}
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6, 7]
    assert records[5]["phase"] == records[7]["phase"] == "long_mixed" and records[7]["rope_theta"] == 1e5
    assert not re.search(r"\b0/7 \[", log)  # never drawn at 0 before the restore
    # the bar as step 7's record drew it (the redraw at close also counts the final save)
    last, *_ = re.findall(r"7/7 \[[\d:]+<[^,\]]*, *([\d.]+)(step/s|s/step)", log)
    bar_seconds_per_step = float(last[0]) if last[1] == "s/step" else 1 / float(last[0])
    tokens = 8 * 256  # the long_mixed phase's batch x seq_len
    step_seconds = [tokens / records[s]["tokens_per_sec"] for s in (6, 7)]  # the compiled steps' own time
    compile_included = tokens / records[5]["tokens_per_sec"]  # step 5's window holds the compile
    assert compile_included > 3 * max(step_seconds)  # (what the bar would show otherwise)
    assert bar_seconds_per_step < 3 * max(step_seconds), (last, step_seconds)
