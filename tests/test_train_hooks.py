"""Trainer's in-process hooks (what examples/quickstart.ipynb uses): init_model starts training from
a ZayaLM in memory, on_log sees every record written to metrics.jsonl as it is written."""

import json

import jax
import numpy as np
import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import abstract_model, create_model
from zaya_jax.train.loop import Trainer
from zaya_jax.checkpoints.model_parts import ModelParts


def _config():
    config = load_config_file("configs/tiny.py")
    config.train.update(steps=2, log_every_steps=1)
    config.optimizer.warmup_steps = 1
    config.eval.every_steps = 2
    config.checkpoint.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0)
    return config


def test_init_model_weights_and_on_log_records(tmp_path, capsys):
    config = _config()
    model = create_model(model_config(config), seed=config.train.seed + 1)  # not what a fresh init would give
    records = []
    trainer = Trainer(config, str(tmp_path), init_model=model, on_log=records.append)
    try:
        assert "start at step 0: the given init_model's weights" in capsys.readouterr().out
        jax.tree.map(np.testing.assert_array_equal, trainer.state.params, ModelParts.arrays(model)[0])
        trainer.run()
    finally:
        trainer.close()
    with open(tmp_path / "metrics.jsonl") as f:
        assert records == [json.loads(line) for line in f]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("eval", 2)]

    # a checkpoint in the workdir still wins over init_model (a restart resumes)
    resumed = Trainer(config, str(tmp_path), init_model=model)
    try:
        assert int(resumed.state.step) == 2 and "start at step 2: restored checkpoint 2" in capsys.readouterr().out
    finally:
        resumed.close()


def test_init_model_of_another_architecture_is_named_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_initial_state", lambda self: pytest.fail("reached model initialisation"))
    config = _config()
    other = abstract_model(model_config(config).replace(num_layers=3))
    with pytest.raises(ValueError, match="init_model: the model has model.num_layers=3 but the config says 2"):
        Trainer(config, str(tmp_path), init_model=other)
