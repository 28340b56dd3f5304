"""FP8 training through Qwix (google/qwix 0.1.8, MaxText's quantization library) against our own
recipe (model.matmul_precision=fp8, zaya_jax.model.fp8) and bf16. Prints JSON; writes
benchmarks/results/fp8_vs_qwix_cpu.json.

  python -m benchmarks.training.fp8_vs_qwix [--steps N]   (default 40; needs the bench extra's qwix)

One model, configs/demo.py's (4 layers, width 128, 8 experts) in bf16, with model.moe_backend=ragged
and moe_matmul_kernel=xla in every mode (the FP8 recipe runs the experts so; the same dispatch keeps
precision the only difference), the same initial weights, the same N batches of 8 x 128 tokens of
the demo corpus (prose, code, math rows in turn), the project's own train step
(zaya_jax.train.step.train_step: lm loss, Muon + AdamW as configs/demo.py, balancing on), in three
modes:
  bf16   model.matmul_precision=default
  ours   model.matmul_precision=fp8 (OCP on CPU): CCA's q, k, v current, v delayed and o einsums
         and the experts' gate, up, down ragged_dot, per-tensor current scaling, e4m3 / e5m2
  qwix   the bf16 model through qwix.quantize_model with qwix.QtProvider rules: weights and
         activations float8_e4m3fn, gradients float8_e5m2, dynamic (current) absmax scales.
         Rules select by module path and op name only, and CCA's convolution and attention einsums
         share the projections' module and op name, so the provider passes on to Qwix only the
         einsums whose spec is a projection's (`ProjectionQtProvider`); `qwix_rules_only` records
         what the rules alone catch (lowered, not trained). Qwix's einsum scales are per-tensor
         (disable_channelwise_axes); its ragged_dot has no such switch: per row of the tokens, per
         output column of the expert weights, per row / column of the gradient.
Steps run round-robin over the modes (one step of each in turn) so all three see the same machine
load; step time is the median over steps 2..N after compilation. Reported per FP8 mode against
bf16: the first and last step's loss relative difference (and the mean over the last 5 steps),
the cosine of every parameter's gradient to bf16's on the first batch (min, median), step times
and ratios, and the FP8 dots of the lowered step: StableHLO ops with f8E4M3FN / f8E5M2 operands
by operand types, and the jaxpr's FP8 dot_general / ragged_dot_general primitives (CPU lowers
ragged_dot to a masked dense dot_general, so the StableHLO text holds no ragged_dot). On CPU XLA
computes FP8 dots in a wider type: times show the cost of quantizing, not FP8 speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import time
import traceback

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import REPO, print_and_save, stack  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.model.build import create_model  # noqa: E402
from zaya_jax.train.balancing import make_controller  # noqa: E402
from zaya_jax.train.objectives import TokenObjective  # noqa: E402
from zaya_jax.train.optimizer import make_optimizer, path_name, schedule  # noqa: E402
from zaya_jax.train.settings import BalancingSettings, OptimizerSettings  # noqa: E402
from zaya_jax.checkpoints.model_parts import ModelParts  # noqa: E402
from zaya_jax.train.state import initial_state  # noqa: E402
from zaya_jax.train.step import objective_value, train_step  # noqa: E402

BATCH, SEQ, LOSS_CHUNK = 8, 128, 128
CONFIG = os.path.join(REPO, "configs", "demo.py")
# CCA's four projection einsums (zaya_jax/model/cca.py): q, k / v current / v delayed, o
PROJECTION_SPECS = frozenset({"bsd,dnh->bsnh", "bsd,dkh->bskh", "bsnh,nhd->bsd"})
F8 = ("f8E4M3FN", "f8E5M2")


def qwix_rules():
    import qwix
    fp8 = dict(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)
    return [qwix.QtRule(module_path="layers/attention", op_names=("einsum",), disable_channelwise_axes=True, **fp8),
            qwix.QtRule(module_path="layers/moe", op_names=("ragged_dot",), **fp8)]


def make_provider(projections_only: bool):
    """A qwix.QtProvider that records each op it quantizes; projections_only: einsums whose spec
    is not a CCA projection's run unquantized whatever the rules say."""
    import qwix
    from qwix._src.utils import flax_util

    class ProjectionQtProvider(qwix.QtProvider):
        def __init__(self, rules):
            super().__init__(rules)
            self.quantized: set[str] = set()  # "module path, op, einsum spec or ragged_dot K x N"

        def _note(self, op: str, detail: str):
            rule, _ = self._get_current_rule_and_op_id(op, only_rule=True)
            if rule is not None:
                self.quantized.add(f"{'/'.join(map(str, flax_util.get_current_module_path()))} {op} {detail}")

        def einsum(self, einsum_str, *operands, **kwargs):
            spec = einsum_str.replace(" ", "")
            if projections_only and spec not in PROJECTION_SPECS:
                return jnp.einsum(einsum_str, *operands, **kwargs)  # interception is off inside a handler
            self._note("einsum", spec)
            return super().einsum(einsum_str, *operands, **kwargs)

        def ragged_dot(self, lhs, rhs, group_sizes, *args, **kwargs):
            self._note("ragged_dot", f"{lhs.shape[-1]}x{rhs.shape[-1]}")
            return super().ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)

    return ProjectionQtProvider(qwix_rules())


def settings():
    config = load_config_file(CONFIG)
    return config, OptimizerSettings(**config.optimizer), BalancingSettings(**config.balancing)


def model_cfg(precision: str):
    config, _, _ = settings()
    return model_config(config).replace(dtype="bfloat16", moe_backend="ragged", moe_matmul_kernel="xla",
                                        matmul_precision=precision)


def demo_batches(n: int, vocab: int) -> list[dict]:
    """n batches [BATCH, SEQ] of documents (bos, text, eos) concatenated per source; rows cycle
    prose, code, math."""
    from zaya_jax.data.demo_corpus import build_demo_corpus
    from zaya_jax.data.tokenizer import Tokenizer
    corpus = build_demo_corpus(vocab_size=vocab, progress=False)
    tok = Tokenizer(corpus.tokenizer, bos_id=2, eos_id=1, pad_id=0)
    sources = ("prose", "code", "math")
    per_source = -(-n * BATCH // len(sources))
    rows = {}
    for name in sources:
        need, ids = per_source * (SEQ + 1), []
        with open(corpus.root / "raw" / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                ids.extend(tok.encode_document(json.loads(line)["text"]).tolist())
                if len(ids) >= need:
                    break
        rows[name] = np.asarray(ids[:need], np.int32).reshape(per_source, SEQ + 1)
    ordered = np.stack([rows[sources[i % 3]][i // 3] for i in range(n * BATCH)]).reshape(n, BATCH, SEQ + 1)
    ones = np.ones((BATCH, SEQ), np.int32)
    return [{"inputs": jnp.asarray(r[:, :-1]), "targets": jnp.asarray(r[:, 1:]), "segment_ids": jnp.asarray(ones),
             "positions": jnp.asarray(np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))),
             "loss_mask": jnp.asarray(ones.astype(np.float32))} for r in ordered]


def fp8_ops_in_text(text: str) -> dict:
    """FP8 dot_general / ragged_dot ops of StableHLO text, keyed by their operand types."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        op = re.search(r"(stablehlo\.dot_general|chlo\.ragged_dot|ragged_dot)", line)
        if op is None or " : (" not in line:
            continue
        operands = line.rsplit(" : (", 1)[1].split(")")[0]
        types = re.findall(r"x(f8E4M3FN|f8E5M2|bf16|f32)>", operands)
        if any(t in F8 for t in types):
            key = f"{op.group(1).split('.')[-1]} {' x '.join(types)}"
            counts[key] = counts.get(key, 0) + 1
    return {"total": sum(counts.values()), "by_operand_types": dict(sorted(counts.items()))}


def fp8_primitives(jaxpr) -> dict:
    """FP8 dot_general / ragged_dot_general primitives of a jaxpr (sub-jaxprs included)."""
    counts: dict[str, int] = {}

    def walk(j):
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name in ("dot_general", "ragged_dot", "ragged_dot_general"):
                dtypes = [str(v.aval.dtype) for v in eqn.invars[:2]]
                if any("float8" in d for d in dtypes):
                    counts[name] = counts.get(name, 0) + 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    return counts


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def train_step_of(parts: ModelParts, steps: int):
    """configs/demo.py's train step for `parts` over `steps` -> (step(state, batch), its optimizer,
    its balancing controller)."""
    _, opt_settings, bal_settings = settings()
    tx, controller = make_optimizer(opt_settings, steps), make_controller(bal_settings)
    step = functools.partial(
        train_step, parts=parts, tx=tx, controller=controller,
        lr_schedule=schedule(opt_settings, steps, opt_settings.learning_rate), rope_theta=parts.config.rope_theta,
        microbatches=1, loss_chunk=LOSS_CHUNK, balance=True, include_skip=False, mesh=None)
    return step, tx, controller


class Mode:
    """One precision mode: its model's parts, its compiled train step and its training state."""

    def __init__(self, name: str, model, params: dict, biases, batch: dict, steps: int):
        self.name, self.parts = name, ModelParts(model)
        step, tx, controller = train_step_of(self.parts, steps)
        value = lambda p: objective_value(self.parts, TokenObjective(), p, biases, None, batch,  # noqa: E731
                                          self.parts.config.rope_theta, LOSS_CHUNK)[0]
        self.first_grads = jax.tree.map(np.asarray, jax.jit(jax.grad(value))(params))
        # copies: initial_state shares one zero among its counters, and the step donates the state
        self.state = jax.tree.map(jnp.copy, initial_state(params, biases, tx, controller, seed=0))
        start = time.perf_counter()
        traced = jax.jit(step, donate_argnums=0).trace(self.state, batch)
        lowered = traced.lower()
        self.fp8_stablehlo = fp8_ops_in_text(lowered.as_text())
        self.fp8_jaxpr = fp8_primitives(traced.jaxpr)
        self.step = lowered.compile()
        self.compile_s = time.perf_counter() - start
        self.losses: list[float] = []
        self.times: list[float] = []

    def run(self, batch: dict):
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        self.losses.append(float(metrics["loss"]))  # blocks until the step is done
        self.times.append(time.perf_counter() - start)


def lowered_only(model, batch: dict, steps: int) -> dict:
    """The FP8 ops of a model's train step, traced and lowered but not compiled."""
    params, biases = ModelParts.arrays(model)
    step, tx, controller = train_step_of(ModelParts(model), steps)
    state = jax.eval_shape(lambda p, b: initial_state(p, b, tx, controller, seed=0), params, biases)
    traced = jax.jit(step).trace(state, batch)
    return {"fp8_stablehlo": fp8_ops_in_text(traced.lower().as_text()), "fp8_jaxpr": fp8_primitives(traced.jaxpr)}


def rel(a: float, b: float) -> float:
    """a / b - 1 to 3 significant digits."""
    return float(f"{a / b - 1:.3g}")


def compare(mode: Mode, base: Mode) -> dict:
    cosines = {}
    flat = jax.tree_util.tree_flatten_with_path(base.first_grads)[0]
    got = dict((path_name(p), v) for p, v in jax.tree_util.tree_flatten_with_path(mode.first_grads)[0])
    for path, ref in flat:
        cosines[path_name(path)] = cosine(got[path_name(path)], ref)
    worst = min(cosines, key=cosines.get)
    med, base_med = statistics.median(mode.times[1:]), statistics.median(base.times[1:])
    return {"first_step_loss_rel_diff": rel(mode.losses[0], base.losses[0]),
            "last_step_loss_rel_diff": rel(mode.losses[-1], base.losses[-1]),
            "last_5_steps_mean_loss_rel_diff": rel(float(np.mean(mode.losses[-5:])), float(np.mean(base.losses[-5:]))),
            "grad_cosine_first_batch": {"min": round(cosines[worst], 4), "min_param": worst,
                                        "median": round(statistics.median(cosines.values()), 4),
                                        "params": len(cosines)},
            "median_step_s_ratio_to_bf16": round(med / base_med, 3)}


def summary(mode: Mode) -> dict:
    return {"first_step_loss": round(mode.losses[0], 5), "last_step_loss": round(mode.losses[-1], 5),
            "last_5_steps_mean_loss": round(float(np.mean(mode.losses[-5:])), 5),
            "median_step_s": round(statistics.median(mode.times[1:]), 4), "compile_s": round(mode.compile_s, 1),
            "fp8_ops_stablehlo": mode.fp8_stablehlo, "fp8_primitives_jaxpr": mode.fp8_jaxpr}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    base_model = create_model(model_cfg("default"), seed=0)
    params, biases = ModelParts.arrays(base_model)
    batches = demo_batches(args.steps, base_model.config.vocab_size)
    result = {"stack": stack(), "cpu_count": os.cpu_count(),
              "config": (f"configs/demo.py's model, model.dtype=bfloat16, moe_backend=ragged, moe_matmul_kernel=xla; "
                         f"batch {BATCH} x {SEQ} demo-corpus tokens; configs/demo.py's optimizer and balancing"),
              "steps": args.steps, "step_time": "median over steps 2..N, modes run round-robin"}
    modes = [Mode("bf16", base_model, params, biases, batches[0], args.steps),
             Mode("ours", create_model(model_cfg("fp8"), seed=0), params, biases, batches[0], args.steps)]
    ours_quantized = ["layers/attention einsum q, k, v current, v delayed, o (per-tensor)",
                      "layers/moe ragged_dot gate, up, down (per-tensor)"]
    import qwix
    result["qwix"] = {"version": qwix.__version__,
                      "rules": [{"module_path": r.module_path, "op_names": list(r.op_names),
                                 "disable_channelwise_axes": r.disable_channelwise_axes} for r in qwix_rules()],
                      "formats": "weight/act float8_e4m3fn, bwd float8_e5m2, dynamic absmax (current) scaling"}
    try:
        rules_only = make_provider(projections_only=False)
        model = qwix.quantize_model(base_model, rules_only, batches[0]["inputs"], methods=("hidden_states",))
        result["qwix_rules_only"] = {**lowered_only(model, batches[0], args.steps),
                                     "quantized": sorted(rules_only.quantized)}
    except Exception:  # noqa: BLE001 — a Qwix failure is a result
        result["qwix_rules_only"] = {"error": traceback.format_exc(limit=3)[-1500:]}
    try:
        provider = make_provider(projections_only=True)
        model = qwix.quantize_model(base_model, provider, batches[0]["inputs"], methods=("hidden_states",))
        modes.append(Mode("qwix", model, params, biases, batches[0], args.steps))
        result["qwix"]["quantized"] = sorted(provider.quantized)
        result["qwix"]["unused_rules"] = len(provider.get_unused_rules())
    except Exception:  # noqa: BLE001
        result["qwix"]["error"] = traceback.format_exc(limit=3)[-1500:]
    for batch in batches:
        for mode in modes:
            mode.run(batch)
    by_name = {m.name: m for m in modes}
    result["modes"] = {m.name: summary(m) for m in modes}
    result["modes"]["ours"]["quantized"] = ours_quantized
    base = by_name["bf16"]
    result["against_bf16"] = {m.name: compare(m, base) for m in modes[1:]}
    if "qwix" in by_name:
        result["qwix_median_step_s_ratio_to_ours"] = round(
            statistics.median(by_name["qwix"].times[1:]) / statistics.median(by_name["ours"].times[1:]), 3)
    result["load_average_1m_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    print_and_save(result, "fp8_vs_qwix_cpu.json")


if __name__ == "__main__":
    main()
