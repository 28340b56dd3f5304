"""zaya_jax in EleutherAI's lm-evaluation-harness (`pip install zaya-jax[eval]`).

  python -m zaya_jax.harness --checkpoint runs/demo --tasks zaya_demo        # the CLI (cli.py)
  lm_eval.simple_evaluate(model=ZayaHarnessLM(checkpoint="runs/demo"), ...)  # the model (model.py)

tasks/ holds the bundled demo task set (built from the demo corpus, no download).
"""


def __getattr__(name):
    if name == "ZayaHarnessLM":  # lm_eval is imported only when the model is asked for
        from zaya_jax.harness.model import ZayaHarnessLM
        return ZayaHarnessLM
    raise AttributeError(name)
