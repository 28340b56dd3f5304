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


def test_evaluate_and_convert_use_the_phase_rope_theta(demo_run, tmp_path):
    workdir, _ = demo_run
    scored = cli("zaya_jax.evaluate", "--checkpoint", workdir)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert json.loads(scored.stdout)["rope_theta"] == 1e5
    exported = cli("zaya_jax.convert", "to_hf", "--checkpoint", workdir, "--out", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["rope_parameters"]["hybrid"]["rope_theta"] == 1e5


def test_train_steps_alone_extends_a_finished_run_in_its_last_phase(demo_run, tmp_path):
    workdir, _ = demo_run
    shutil.copytree(workdir, tmp_path / "run")
    corpus = workdir.parent / "corpus"
    steps = [a for a in SMALL_DEMO if not a.startswith("--config.train.steps")]
    done = run_train(tmp_path / "run", *steps, "--config.train.steps=6", f"--config.data.demo.cache_dir={corpus}",
                     "--config.monitor.progress_bar=True", config="configs/demo.py")
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "start at step 4: restored checkpoint 4" in log and "data exhausted" not in log
    assert "train.steps=6 is 2 batches past the curriculum: its last phase 'long_mixed' continues" in log
    records = {r["step"]: r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))}
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    assert records[5]["phase"] == records[6]["phase"] == "long_mixed" and records[6]["rope_theta"] == 1e5
    *_, last = re.findall(r"6/6 \[(\d+):(\d+)<[^,\]]*, *([\d.]+)(step/s|s/step)", log)  # the bar at the end
    elapsed, rate = 60 * int(last[0]) + int(last[1]), float(last[2])
    steps = elapsed * (rate if last[3] == "step/s" else 1 / rate)
    assert elapsed >= 2 and 1 <= steps <= 3.5, last  # 2 steps this session, not the 6 the bar shows done
