"""A Trainer on the Grain curriculum pipeline, stopped hard and resumed, logs bit-identical losses
to the run that was never stopped, including across a phase boundary (seq_len 32 -> 64 and
rope_theta 1e4 -> 1e5: a second compilation) with the stop on either side of it.

Sources are small demo-like corpora (three sources of documents that repeat a random motif,
so the loss falls) written with zaya_jax.data.prepare.write_tokenized; the pipeline prefetches
(prefetch_buffer_size=2), so the resumed iterator state must not count prefetched batches.
The hard stop is an exception raised from the loop's per-step seam right after a step: nothing
after it (no final save) happens; the next Trainer in the workdir restores the last periodic
checkpoint (every 2 steps) and the data position saved with it.
"""

import json

import ml_collections
import numpy as np
import pytest

from zaya_jax.config_files import load_config_file
from zaya_jax.data import prepare
from zaya_jax.train.loop import Trainer
from zaya_jax.train.monitor import read_metrics

TOKENIZER = {"sha256": "synthetic", "vocab_size": 512, "bos_id": 2, "eos_id": 1, "pad_id": 0}
PHASE_STEPS = (3, 3)  # the boundary is after step 3


class HardStop(Exception):
    pass


class StoppedTrainer(Trainer):
    stop_after = None

    def _after_step(self, step):
        if step == self.stop_after:
            raise HardStop(step)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root, rng, paths = tmp_path_factory.mktemp("sources"), np.random.default_rng(0), {}
    for name in ("prose", "code", "math"):
        docs = [np.concatenate([[2], np.resize(rng.integers(3, 512, rng.integers(3, 12)), rng.integers(10, 90)), [1]])
                for _ in range(150)]
        prepare.write_tokenized(str(root / name), docs, tokenizer_info=TOKENIZER, num_shards=2)
        paths[name] = str(root / name)
    return paths


def _config(sources):
    config = load_config_file("configs/tiny.py")
    phases = tuple(ml_collections.ConfigDict(dict(
        name=name, token_budget=steps * 8 * seq_len, seq_len=seq_len, rope_theta=theta, global_batch_size=8,
        weights=weights)) for name, steps, seq_len, theta, weights in (
            ("short", PHASE_STEPS[0], 32, 1e4, {"prose": 0.7, "code": 0.3}),
            ("long", PHASE_STEPS[1], 64, 1e5, {"prose": 0.2, "code": 0.4, "math": 0.4})))
    config.data = ml_collections.ConfigDict(dict(
        sources=sources, tokenizer="unused", phases=phases, pad_id=0, heldout_fraction=0.05, packing_bins=4,
        worker_count=0, worker_buffer_size=1, prefetch_buffer_size=2,
        eval=dict(seq_len=32, batch_size=8, max_batches=1)))
    config.train.update(data="pipeline", steps=sum(PHASE_STEPS), log_every_steps=1)
    config.optimizer.update(name="adamw", warmup_steps=1)
    config.checkpoint.update(every_steps=2, async_save=True)
    config.eval.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0)
    return config


def _run(config, workdir, stop_after=None):
    trainer = StoppedTrainer(config, str(workdir))
    trainer.stop_after = stop_after
    try:
        trainer.run()
    except HardStop:
        pass
    finally:
        trainer.close()


def _losses(workdir):
    """{step: (loss, phase, rope_theta)}; a step logged again after a resume keeps its last record."""
    return {r["step"]: (r["loss"], r["phase"], r["rope_theta"]) for r in read_metrics(str(workdir / "metrics.jsonl"))}


@pytest.fixture(scope="module")
def straight(sources, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    _run(_config(sources), workdir)
    return _losses(workdir)


def test_the_straight_run_crosses_the_phase_boundary(straight):
    assert sorted(straight) == list(range(1, sum(PHASE_STEPS) + 1))
    assert {straight[s][1:] for s in (1, 2, 3)} == {("short", 1e4)}
    assert {straight[s][1:] for s in (4, 5, 6)} == {("long", 1e5)}
    assert all(np.isfinite(v[0]) for v in straight.values())


@pytest.mark.parametrize("stop_after,resumes_at", [(3, 2), (5, 4)])
def test_stopped_and_resumed_run_logs_bit_identical_losses(sources, straight, tmp_path, stop_after, resumes_at):
    """Stop after step 3 (last checkpoint 2: the resumed run crosses the boundary itself) or after
    step 5 (checkpoint 4: it resumes inside the second phase)."""
    _run(_config(sources), tmp_path, stop_after=stop_after)
    assert max(_losses(tmp_path)) == stop_after  # the stop happened where intended
    _run(_config(sources), tmp_path)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [*range(1, stop_after + 1), *range(resumes_at + 1, sum(PHASE_STEPS) + 1)]
    assert _losses(tmp_path) == straight  # exact float equality, phase names and rope_theta included
