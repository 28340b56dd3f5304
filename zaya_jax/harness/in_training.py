"""lm-evaluation-harness tasks inside the trainer's process (config eval.harness_*).

  eval.harness_tasks         comma-separated task or group names ('' : off)
  eval.harness_every_steps   0: at every checkpoint save (checkpoint.every_steps); else every N steps;
                             the final step always
  eval.harness_limit         documents per task (0: all; below 1: a fraction)
  eval.harness_include_path  a directory of extra task YAMLs
  eval.harness_batch_size    rows scored together

TrainingHarness(config, settings) checks all of it at start-up, before anything compiles (lm-eval
installed, the task names known, the run's tokenizer); `run(step, model)` scores the model of the
step in memory (ZayaHarnessLM(model=...)) and returns the record the trainer writes to
metrics.jsonl and TensorBoard: {"kind": "harness", "step", "harness/<task>/<metric>": value}.
In a multi-process run every process gathers the weights to its host (one collective), process 0
scores them on its local devices while the others wait at a barrier (ZAYA_BARRIER_TIMEOUT_S, an
hour by default), and process 0 writes the record, as it writes every other.
The trainer runs it before that step's checkpoint is saved, so a run stopped by a signal has its
scores for every step it saved, and a resumed run goes on from there.
"""

from __future__ import annotations

import importlib.util
import math

from zaya_jax.config import ConfigError
from zaya_jax.errors import UserError

INSTALL = "pip install 'zaya-jax[eval]'"


class TrainingHarness:
    def __init__(self, config, settings):
        e = settings.eval
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(f"eval.harness_tasks needs lm-eval, which is not installed: {INSTALL}")
        if "data" not in config or not config.data.get("tokenizer"):
            raise ConfigError("eval.harness_tasks needs the run's tokenizer (data.tokenizer); synthetic data has none")
        from zaya_jax.data.sources import tokenizer_path
        from zaya_jax.harness.tasks import task_manager, task_names
        self.tokenizer = tokenizer_path(config.data)
        try:
            self.manager = task_manager(e.harness_include_path or None)
            self.tasks = task_names(self.manager, e.harness_tasks)
        except (UserError, OSError, ValueError) as err:  # an unknown task, or lm_eval refusing a YAML directory
            raise ConfigError(f"eval.harness_tasks / harness_include_path: {err}") from err
        self.every = e.harness_every_steps or settings.checkpoint.every_steps
        self.limit, self.batch_size = e.harness_limit or None, e.harness_batch_size

    def due(self, step: int) -> bool:
        """Whether `step` is one the tasks are scored at during training (the final step is scored too)."""
        return bool(self.every and step % self.every == 0)

    def run(self, step: int, model) -> dict:
        """Scores `model` (a ZayaLM, its arrays on the training mesh) on the tasks -> the metrics record
        of `step` (on processes other than 0: the record without scores)."""
        import jax

        from zaya_jax.parallel import distributed
        if jax.process_count() == 1:
            return self.score(step, model)
        model = on_this_host(model)
        record = self.score(step, model) if jax.process_index() == 0 else {"kind": "harness", "step": step}
        distributed.barrier(f"lm-eval harness scored step {step}")
        return record

    def score(self, step: int, model) -> dict:
        import lm_eval

        from zaya_jax.harness.model import ZayaHarnessLM
        lm = ZayaHarnessLM(model=model, tokenizer=self.tokenizer, batch_size=self.batch_size)
        results = lm_eval.simple_evaluate(model=lm, tasks=self.tasks, task_manager=self.manager, limit=self.limit,
                                          log_samples=False, bootstrap_iters=0)
        record = {"kind": "harness", "step": step}
        for task, metrics in results["results"].items():
            for key, value in metrics.items():
                metric, _, kept = key.partition(",")
                if kept and "stderr" not in metric and isinstance(value, (int, float)) and math.isfinite(value):
                    record[f"harness/{task}/{metric if kept == 'none' else f'{metric}_{kept}'}"] = float(value)
        return record


def on_this_host(model):
    """A ZayaLM whose arrays span processes -> the same model with numpy arrays in this host's memory,
    for ZayaHarnessLM to place on the local devices (every process must call it: the gather is a
    collective). Numpy, not jax arrays: under the trainer's mesh a new jax array lands on the global mesh."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    graphdef, state = nnx.split(model)

    def here(x):  # process_allgather leaves a global array replicated, still on every process's devices
        return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
    return nnx.merge(graphdef, jax.tree.map(here, multihost_utils.process_allgather(state, tiled=True)))
