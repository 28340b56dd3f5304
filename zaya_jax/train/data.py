"""What the trainer reads: the curriculum pipeline, or synthetic batches that need no data.

Either way the trainer gets a grain DatasetIterator (so its state checkpoints with
grain.checkpoint.CheckpointSave), its phases (PhaseInfo: seq_len, rope_theta, global batch, number
of batches) and held-out evaluation batches per source. Batches are dicts of numpy [B/n, L]
arrays: inputs, targets, segment_ids, positions (int32), loss_mask (float32), rows
[p*B/n, (p+1)*B/n) of the global batch for process p of n.

Synthetic data (train.data='synthetic'; configs/tiny.py, configs/bench_small.py): batch k is a
function of (seed, k) only. Each row packs documents of random tokens in which a random motif of
4-16 tokens repeats, so a model can learn to copy it and the loss falls; held-out batches use
another seed.
"""

from __future__ import annotations

import copy
from typing import Any

import grain
import jax
import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data.curriculum import PhaseInfo
from zaya_jax.parallel.distributed import local_batch_rows
from zaya_jax.train.settings import Settings

FIRST_TOKEN = 3  # ids below are pad / eos / bos in every shipped config
EVAL_SEED_OFFSET = 1_000_003


def synthetic_row(rng: np.random.Generator, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
    """One packed row of [seq_len] arrays: documents of a repeated random motif."""
    tokens, segments, positions = [], [], []
    segment = 0
    while len(tokens) < seq_len + 1:
        segment += 1
        motif = rng.integers(FIRST_TOKEN, vocab, rng.integers(4, 17))
        length = int(rng.integers(seq_len // 4, seq_len + 2))
        doc = np.resize(motif, length)
        tokens.extend(doc)
        segments.extend([segment] * length)
        positions.extend(range(length))
    tokens, segments = np.asarray(tokens[:seq_len + 1]), np.asarray(segments[:seq_len + 1])
    same_doc = segments[1:] == segments[:-1]
    return {"inputs": tokens[:-1].astype(np.int32), "targets": tokens[1:].astype(np.int32),
            "segment_ids": segments[:-1].astype(np.int32), "positions": np.asarray(positions[:seq_len], np.int32),
            "loss_mask": same_doc.astype(np.float32)}


def synthetic_batch(seed: int, index: int, batch: int, seq_len: int, vocab: int, rows: slice) -> dict:
    rng = np.random.default_rng([seed, index])
    all_rows = [synthetic_row(rng, seq_len, vocab) for _ in range(batch)][rows]
    return {k: np.stack([r[k] for r in all_rows]) for k in all_rows[0]}


class SyntheticIterator(grain.DatasetIterator):
    """Synthetic global batches (this process's rows), without end; state: the next batch index."""

    def __init__(self, phase: PhaseInfo, vocab: int, seed: int):
        super().__init__()
        self.phase, self.vocab_size = phase, vocab
        self._seed, self._index = seed, 0
        self._rows = local_batch_rows(phase.global_batch_size)

    def __next__(self) -> dict[str, np.ndarray]:
        self._index += 1
        return synthetic_batch(self._seed, self._index - 1, self.phase.global_batch_size, self.phase.seq_len,
                               self.vocab_size, self._rows)

    def get_state(self) -> dict[str, Any]:
        return {"synthetic_batch": self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        self._index = state["synthetic_batch"]

    def close(self) -> None:
        pass


def synthetic_phase(settings: Settings) -> PhaseInfo:
    t = settings.train
    return PhaseInfo(index=0, name="synthetic", token_budget=t.steps * t.global_batch_size * t.seq_len,
                     seq_len=t.seq_len, rope_theta=settings.model.rope_theta, global_batch_size=t.global_batch_size,
                     weights=(("synthetic", 1.0),))


def curriculum_extension(config, settings: Settings) -> int:
    """Global batches that train.steps asks for beyond the curriculum as written (0 if none)."""
    if settings.train.data == "synthetic":
        return 0
    from zaya_jax.data.curriculum import parse_phases
    phases = parse_phases(config.data, process_count=jax.process_count())
    return max(0, settings.train.steps - sum(p.num_batches for p in phases))


def training_data_config(config, settings: Settings):
    """config.data, its last phase extended by curriculum_extension batches: `--config.train.steps=N`
    alone trains a finished run on, in its last phase (docs/training.md)."""
    extra = curriculum_extension(config, settings)
    if not extra:
        return config.data
    from zaya_jax.data.curriculum import parse_phases
    last = parse_phases(config.data, process_count=jax.process_count())[-1]
    data = copy.deepcopy(config.data)  # copy_and_resolve_references would share the phases tuple's dicts
    data.phases[-1].token_budget = (last.num_batches + extra) * last.tokens_per_batch
    return data


def phases_of(config, settings: Settings) -> tuple[PhaseInfo, ...]:
    """The phases (the last one extended to train.steps), validated without opening any file
    (ConfigError naming the field)."""
    if settings.train.data == "synthetic":
        return (synthetic_phase(settings),)
    from zaya_jax.data.curriculum import parse_phases
    return parse_phases(training_data_config(config, settings), process_count=jax.process_count())


def open_training_data(config, settings: Settings) -> grain.DatasetIterator:
    """The training iterator; opening a missing source fails naming the field and path."""
    if settings.train.data == "synthetic":
        return SyntheticIterator(synthetic_phase(settings), settings.model.vocab_size, settings.train.seed)
    from zaya_jax.data import build_pipeline
    pipeline = build_pipeline(training_data_config(config, settings), process_index=jax.process_index(),
                              process_count=jax.process_count(), seed=settings.train.seed)
    if pipeline.vocab_size > settings.model.vocab_size:
        raise ConfigError(f"data.sources were tokenized with a vocabulary of {pipeline.vocab_size}, larger than "
                         f"model.vocab_size={settings.model.vocab_size}")
    return pipeline


def eval_batches(config, settings: Settings) -> dict[str, list[dict[str, np.ndarray]]]:
    """{source: [batch, ...]} of held-out batches (this process's rows)."""
    max_batches = settings.eval.max_batches or None
    if settings.train.data == "synthetic":
        t = settings.train
        rows = local_batch_rows(t.global_batch_size)
        return {"synthetic": [synthetic_batch(t.seed + EVAL_SEED_OFFSET, i, t.global_batch_size, t.seq_len,
                                              settings.model.vocab_size, rows) for i in range(max_batches or 4)]}
    from zaya_jax.data import build_eval_batches
    return build_eval_batches(config.data, max_batches=max_batches, process_index=jax.process_index(),
                              process_count=jax.process_count())


def phase_at_step(phases: tuple[PhaseInfo, ...], step: int) -> PhaseInfo:
    """The phase whose batches include global batch number `step` (the last phase past the end)."""
    for phase in phases:
        if step < phase.num_batches:
            return phase
        step -= phase.num_batches
    return phases[-1]
