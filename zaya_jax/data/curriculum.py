"""The data config: sources, curriculum phases and pipeline options, and its validation.

Schema (an ml_collections.ConfigDict, usually `config.data`):

  sources               {name: path}   prepared dataset dirs, or 'demo:prose' etc. (demo corpus)
  made_by               {name: command} optional: the command that writes source `name` ('{}'
                                       standing for its path), named when the source is missing
  tokenizer             path           the tokenizer file the sources were prepared with
                                       ('demo:tokenizer' for the demo corpus); for decoding
  phases                tuple of       each: name, token_budget (tokens of global batches,
                                       B*L per batch), seq_len L, rope_theta, global_batch_size B,
                                       weights {source: weight} (fractions of target tokens,
                                       i.e. row positions, also for chat and preference
                                       sources; any positive scale; sources left out get 0)
  pad_id                int            the model's pad id (padding positions of inputs/targets)
  heldout_fraction      float          trailing fraction of each source held out for evaluation
  packing_bins          int            rows packed together first-fit per lane (more: less padding)
  worker_count          int            Grain worker processes (0: none); must divide B / processes
  worker_buffer_size    int            batches each worker prefetches
  prefetch_buffer_size  int            batches a main-process thread prefetches (0: none)
  eval                  seq_len, batch_size, max_batches: defaults of build_eval_batches
  demo                  cache_dir, max_docs, vocab_size, seed: how to build the demo corpus
                        (only read when a source is 'demo:...')

Override from the command line like `--config.data.phases[1].seq_len=512`.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from zaya_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class PhaseInfo:
    """One curriculum phase, validated. `weights` lists only sources with weight > 0."""

    index: int
    name: str
    token_budget: int
    seq_len: int
    rope_theta: float
    global_batch_size: int
    weights: tuple[tuple[str, float], ...]

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def num_batches(self) -> int:
        """Global batches in this phase: the first whose tokens reach the budget is the last."""
        return math.ceil(self.token_budget / self.tokens_per_batch)


def _positive_int(value, field: str) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or value <= 0):
        raise ConfigError(f"{field} must be a positive integer, got {value!r}")
    return int(value)


def _phase(cfg, index: int, sources: list[str], global_batch_size: int | None) -> PhaseInfo:
    field = f"data.phases[{index}]"
    cfg = ml_collections.ConfigDict(cfg) if isinstance(cfg, dict) else cfg
    for key in ("name", "token_budget", "seq_len", "rope_theta", "global_batch_size", "weights"):
        if key not in cfg:
            raise ConfigError(f"{field}.{key} is missing")
    if not isinstance(cfg.name, str) or not cfg.name:
        raise ConfigError(f"{field}.name must be a non-empty string, got {cfg.name!r}")
    rope_theta = cfg.rope_theta
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or rope_theta <= 0:
        raise ConfigError(f"{field}.rope_theta must be a positive number, got {rope_theta!r}")
    weights = dict(cfg.weights)
    for name, w in weights.items():
        if name not in sources:
            raise ConfigError(f"{field}.weights names unknown source {name!r} (data.sources has {sources})")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{field}.weights.{name} must be a finite number >= 0, got {w!r}")
    if not sum(weights.values()) > 0:
        raise ConfigError(f"{field}.weights must sum to a positive number, got {weights}")
    return PhaseInfo(
        index=index, name=cfg.name,
        token_budget=_positive_int(cfg.token_budget, f"{field}.token_budget"),
        seq_len=_positive_int(cfg.seq_len, f"{field}.seq_len"),
        rope_theta=float(rope_theta),
        global_batch_size=_positive_int(global_batch_size or cfg.global_batch_size, f"{field}.global_batch_size"),
        weights=tuple((n, float(w)) for n, w in weights.items() if w > 0))


def parse_phases(data_config, *, global_batch_size: int | None = None,
                 process_count: int = 1) -> tuple[PhaseInfo, ...]:
    """Validates the config (cheaply, touching no file) and returns its phases.

    Raises ConfigError (a ValueError) naming the offending field. `global_batch_size`, if given, replaces every
    phase's; each phase's B must split evenly over processes and then over workers.
    """
    for key in ("sources", "phases", "pad_id", "heldout_fraction", "packing_bins", "worker_count",
                "worker_buffer_size", "prefetch_buffer_size"):
        if key not in data_config:
            raise ConfigError(f"data.{key} is missing")
    if not dict(data_config.sources):
        raise ConfigError("data.sources must name at least one source")
    sources = list(data_config.sources)
    for name in sources:
        if not isinstance(data_config.sources[name], str) or not data_config.sources[name]:
            raise ConfigError(f"data.sources.{name} must be a path string, got {data_config.sources[name]!r}")
    unknown = sorted(set(data_config.get("made_by") or {}) - set(sources))
    if unknown:
        raise ConfigError(f"data.made_by names unknown source {unknown[0]!r} (data.sources has {sources})")
    if not data_config.phases:
        raise ConfigError("data.phases must list at least one phase")
    phases = tuple(_phase(p, i, sources, global_batch_size) for i, p in enumerate(data_config.phases))
    if len({p.name for p in phases}) != len(phases):
        raise ConfigError(f"data.phases names must be unique, got {[p.name for p in phases]}")
    if not 0 <= data_config.heldout_fraction < 1:
        raise ConfigError(f"data.heldout_fraction must be in [0, 1), got {data_config.heldout_fraction!r}")
    if isinstance(data_config.pad_id, bool) or not isinstance(data_config.pad_id, int) or data_config.pad_id < 0:
        raise ConfigError(f"data.pad_id must be an integer >= 0, got {data_config.pad_id!r}")
    _positive_int(data_config.packing_bins, "data.packing_bins")
    for key in ("worker_count", "worker_buffer_size", "prefetch_buffer_size"):
        value = data_config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"data.{key} must be an integer >= 0, got {value!r}")
    _positive_int(process_count, "process_count")
    workers = max(1, data_config.worker_count)
    for p in phases:
        if p.global_batch_size % process_count:
            raise ConfigError(f"data.phases[{p.index}].global_batch_size={p.global_batch_size} does not split "
                              f"evenly over {process_count} processes")
        if p.global_batch_size // process_count % workers:
            raise ConfigError(f"data.worker_count={workers} must divide the per-process batch "
                              f"{p.global_batch_size // process_count} of phase {p.name!r}")
    return phases


def _phase_config(name: str, token_budget: int, seq_len: int, rope_theta: float, global_batch_size: int,
                  weights: dict[str, float]) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(name=name, token_budget=token_budget, seq_len=seq_len,
                                          rope_theta=rope_theta, global_batch_size=global_batch_size,
                                          weights=weights))


def _common(sources: dict[str, str], tokenizer: str, phases: tuple, eval_seq_len: int,
            eval_batch_size: int) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        sources=sources, tokenizer=tokenizer, phases=phases, pad_id=0, heldout_fraction=0.02,
        packing_bins=8, worker_count=0, worker_buffer_size=2, prefetch_buffer_size=2,
        eval=dict(seq_len=eval_seq_len, batch_size=eval_batch_size, max_batches=8)))


def demo_data_config() -> ml_collections.ConfigDict:
    """The bundled demo corpus (Shakespeare prose, Python stdlib code, generated math), 3 phases.

    Phase 1 is prose-heavy and phase 2 code/math-heavy, both at L=128 with rope_theta 1e4;
    phase 3 mixes all three at L=256 with rope_theta 1e5 (a small echo of ZAYA1's context
    extension). Each phase is 400 batches' worth at its shape: 819,200 tokens.
    """
    b = 16
    phases = (
        _phase_config("prose_heavy", 400 * b * 128, 128, 1e4, b, {"prose": 0.7, "code": 0.15, "math": 0.15}),
        _phase_config("code_math_heavy", 400 * b * 128, 128, 1e4, b, {"prose": 0.2, "code": 0.4, "math": 0.4}),
        _phase_config("long_mixed", 200 * b * 256, 256, 1e5, b, {"prose": 0.34, "code": 0.33, "math": 0.33}),
    )
    config = _common({"prose": "demo:prose", "code": "demo:code", "math": "demo:math"}, "demo:tokenizer",
                     phases, eval_seq_len=256, eval_batch_size=8)
    config.demo = ml_collections.ConfigDict(dict(cache_dir="", max_docs=0, vocab_size=4096, seed=0))
    return config


def zaya1_base_data_config() -> ml_collections.ConfigDict:
    """ZAYA1-base's three phases; sources are placeholders for the user's prepared directories.

    Known [PAPER]: 8T tokens at 4k with rope_theta 1e4 (web-heavy), 4T at 4k with 1e4 (more
    math, code, reasoning, instruction), then a long-context + reasoning mid-train at 32k with
    1e6. Assumed: phase 3's budget (2T = the launch post's 14T total minus 12T), every mixture
    weight, and the batch (4096 x 4096 tokens, kept at 16.8M tokens per batch at 32k). Point
    each source at a dir written by `python -m zaya_jax.data.prepare` with the Gemma-3
    tokenizer; an unset placeholder fails with FileNotFoundError naming the field and path.
    """
    names = ("web", "multilingual", "code", "math", "reasoning", "instruction", "long_context")
    sources = {n: f"/data/zaya1/{n}" for n in names}
    phases = (
        _phase_config("pretrain_web_heavy", 8 * 10**12, 4096, 1e4, 4096,
                      {"web": 0.62, "multilingual": 0.08, "code": 0.12, "math": 0.10, "reasoning": 0.08}),
        _phase_config("pretrain_math_code_reasoning", 4 * 10**12, 4096, 1e4, 4096,
                      {"web": 0.30, "multilingual": 0.05, "code": 0.22, "math": 0.20, "reasoning": 0.15,
                       "instruction": 0.08}),
        _phase_config("midtrain_long_context_reasoning", 2 * 10**12, 32768, 1e6, 512,
                      {"long_context": 0.40, "reasoning": 0.30, "code": 0.10, "math": 0.10, "web": 0.10}),
    )
    return _common(sources, "/data/zaya1/tokenizer/tokenizer.json", phases, eval_seq_len=4096, eval_batch_size=64)
