"""Whether an HF export computes the same model as the ZayaLM it was written from.

Two kinds of check, both raising `ExportMismatch` (a UserError: the export is refused, and the
message says why and what to do):

  before writing   schema_problem(model, schema): what a schema cannot express at all
                   - native schema, base layout: a token routed to the skip slot outputs p * x here
                     and 0 in transformers; allowed only when no token can ever take the skip slot
                     (skip_unreachable: the biases alone rule it out, for every input)
                   - native schema: transformers' from_pretrained resets every skip-slot balancing
                     bias to -1 (docs: zaya1-spec), so any other value would route differently there
  after writing    verify_export(model, directory): the written files, read back by our own
                   loader, give every architecture field of the source config and the same logits on
                   a probe batch (fp32, tolerance PROBE_TOLERANCE of the logits' scale)
"""

from __future__ import annotations

import jax
import numpy as np

from zaya_jax.checkpoints.hf_load import load_hf
from zaya_jax.config import RUNTIME_MODEL_FIELDS
from zaya_jax.errors import UserError
from zaya_jax.model.zaya import ZayaLM


HF_SKIP_BIAS = -1.0          # what transformers' from_pretrained sets every skip-slot bias to
PROBE_SHAPE = (2, 24)        # [batch, seq] of the probe batch
PROBE_TOLERANCE = 1e-5       # max |difference| / max |logit|


class ExportMismatch(UserError):
    """The export would compute a different model than its source."""


def balancing_biases(model: ZayaLM) -> np.ndarray:
    """[L, E+1] float32, skip slot last."""
    return np.asarray(model.layers.moe.router.balancing_biases[...], np.float32)


def skip_unreachable(biases: np.ndarray) -> np.ndarray:
    """[L] bool: the skip slot can never be chosen in that layer, whatever the input.

    The choice is argmax(p + b) over a softmax p (0 <= p <= 1), the skip slot last, and argmax
    breaks ties toward the lower index; so skip loses to every input when p_skip + b_skip <=
    1 + b_skip <= max_j b_j <= max_j (p_j + b_j) (each step holds in fp32 rounding too).
    """
    return 1.0 + biases[:, -1] <= biases[:, :-1].max(axis=-1)


def schema_problem(model: ZayaLM, schema: str) -> str | None:
    """Why `schema` cannot carry `model` unchanged (one line), or None."""
    if schema != "native":
        return None
    biases = balancing_biases(model)
    if model.config.layout == "base":
        reachable = np.flatnonzero(~skip_unreachable(biases))
        if reachable.size:
            layer = int(reachable[0])
            return (f"this base-layout model can route tokens to the skip slot (layer {layer}: skip bias "
                    f"{biases[layer, -1]:.4g}, largest expert bias {biases[layer, :-1].max():.4g}), where it passes "
                    "p * x; transformers' native layout outputs 0 there")
    moved = np.flatnonzero(biases[:, -1] != HF_SKIP_BIAS)
    if moved.size:
        layer = int(moved[0])
        return (f"layer {layer}'s skip-slot balancing bias is {biases[layer, -1]:.4g}; transformers' "
                f"from_pretrained resets it to {HF_SKIP_BIAS}, which would change the routing (train with "
                "balancing.include_skip=False to keep it there)")
    return None


def check_schema(model: ZayaLM, schema: str) -> None:
    problem = schema_problem(model, schema)
    if problem:
        raise ExportMismatch(f"cannot export as the {schema} schema: {problem}.\n"
                             "Export Zyphra's original names with --schema original (zaya_jax.load_hf reads them; "
                             "transformers cannot), or train with --config.model.layout=native.")


def probe_ids(vocab_size: int) -> np.ndarray:
    """A fixed [2, 24] batch of ids (the low ids of every shipped config are special, so start at 3)."""
    return np.random.default_rng(0).integers(min(3, vocab_size - 1), vocab_size, PROBE_SHAPE)


def verify_export(model: ZayaLM, directory, schema: str) -> str:
    """Reads `directory` back (our loader, `model`'s runtime fields) and compares it with `model`;
    returns what was checked, as one line."""
    cfg = model.config
    written = load_hf(directory, **{f: getattr(cfg, f) for f in RUNTIME_MODEL_FIELDS})
    expected = cfg.replace(layout="native") if schema == "native" else cfg  # base -> native: checked above
    for name, value in vars(written.config).items():
        if name not in RUNTIME_MODEL_FIELDS and value != getattr(expected, name):
            raise ExportMismatch(
                f"cannot export as the {schema} schema: model.{name}={getattr(expected, name)!r} reads back as "
                f"{value!r} (the schema has no place for it).\nTrain with --config.model.{name}={value!r}, or "
                f"export with --schema {'original' if schema == 'native' else 'native'}.")
    ids = probe_ids(cfg.vocab_size)
    forward = jax.jit(lambda m, x: m(x))  # one compilation serves both (same graph)
    found = compare_probe_logits(forward(model, ids), forward(written, ids), f"the {schema} export", "a probe batch")
    return (f"checked: the {schema} export read back gives every architecture field and the source's logits on a "
            f"{PROBE_SHAPE[0]} x {PROBE_SHAPE[1]} probe batch ({found})")


def compare_probe_logits(source, reread, what: str, probe: str) -> str:
    """Raises ExportMismatch unless the read-back logits are the source's within PROBE_TOLERANCE of
    their scale; returns the figures, as words."""
    source, reread = np.asarray(source, np.float32), np.asarray(reread, np.float32)
    scale = max(float(np.abs(source).max()), 1e-30)
    error = float(np.abs(source - reread).max())
    if not error <= PROBE_TOLERANCE * scale:
        raise ExportMismatch(f"{what} computes different logits than its source on {probe} "
                             f"(max difference {error:.3g}, logits up to {scale:.3g}); nothing was written")
    return f"max difference {error:.3g}, logits up to {scale:.3g}, tolerance {PROBE_TOLERANCE:g} of the scale"
