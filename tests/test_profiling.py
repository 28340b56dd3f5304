"""monitor.profile_start_step: a jax.profiler trace of the chosen steps lands in WORKDIR/profile,
and the compiled step's ops carry the model's block scopes, so a profile sums per block."""

import glob
import gzip
import json
import re

import jax
import pytest

from zaya_jax.config_files import load_config_file
from zaya_jax.train.loop import Trainer
from zaya_jax.train.profiling import BLOCK_SCOPES, block_of
from zaya_jax.train.settings import settings_from_config


def _config(steps: int, profile_start: int, profile_steps: int):
    config = load_config_file("configs/tiny.py")
    config.train.update(steps=steps, log_every_steps=steps)
    config.optimizer.warmup_steps = 1
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0,
                          profile_start_step=profile_start, profile_steps=profile_steps)
    return config


def _trace_events(workdir) -> list[dict]:
    traces = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert len(traces) == 1, traces
    assert glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    with gzip.open(traces[0]) as f:
        return json.load(f)["traceEvents"]


def test_trace_of_chosen_steps_and_block_scopes_in_op_names(tmp_path, capsys):
    trainer = Trainer(_config(steps=4, profile_start=1, profile_steps=2), str(tmp_path))
    try:
        trainer.run()
        hlo = trainer.compiled_step_text()
    finally:
        trainer.close()
    assert "profiler trace (from step 2) written to" in capsys.readouterr().out
    # two traced steps: the jitted step ran twice inside the trace window
    names = [e.get("name", "") for e in _trace_events(tmp_path) if e.get("ph") == "X"]
    dispatches = [n for n in names if n.startswith("PjitFunction(run_train_step)")]
    assert len(dispatches) in (2, 4), dispatches  # one or two trace events per call, by jax version
    blocks = {block_of(name) for name in re.findall(r'op_name="([^"]*)"', hlo)}
    assert blocks == set(BLOCK_SCOPES) | {"other"}, blocks


def test_block_of_reads_scopes_through_transformations():
    assert block_of("jit(run_train_step)/while/body/closed_call/transpose(jvp(loss_head))/dot_general") == "loss_head"
    assert block_of("jit(f)/jvp()/while/body/closed_call/moe/router/jit(take_along_axis)/gather") == "moe/router"
    assert block_of("jit(f)/jvp()/moe/mul") == "moe"
    assert block_of("jit(f)/while/body/closed_call/transpose(jvp(moe))/experts/while/body/dot_general") == "moe/experts"
    assert block_of("jit(f)/moe_like/attention_x/add") == "other"


def test_trace_ends_with_a_run_cut_short(tmp_path):
    trainer = Trainer(_config(steps=2, profile_start=1, profile_steps=5), str(tmp_path))
    try:
        trainer.run()
    finally:
        trainer.close()
    assert _trace_events(tmp_path)


def test_profile_steps_must_be_positive():
    with pytest.raises(ValueError, match="monitor.profile_steps must be > 0, got 0"):
        settings_from_config(_config(steps=2, profile_start=1, profile_steps=0))


def test_close_ends_a_trace_left_open_by_a_failed_run(tmp_path, monkeypatch):
    def fail_at_step_2(self, step):
        if step == 2:
            raise RuntimeError("injected")
    monkeypatch.setattr(Trainer, "_after_step", fail_at_step_2)
    trainer = Trainer(_config(steps=4, profile_start=1, profile_steps=2), str(tmp_path / "run"))
    try:
        with pytest.raises(RuntimeError, match="injected"):
            trainer.run()
        assert trainer.profiler.active
    finally:
        trainer.close()
    jax.profiler.start_trace(str(tmp_path / "next"))  # raises if the failed run's trace were still open
    jax.profiler.stop_trace()
