"""What the trainer reads: the curriculum pipeline, or synthetic batches that need no data.

Either way the trainer gets a grain DatasetIterator (so its state checkpoints with
grain.checkpoint.CheckpointSave), its phases (PhaseInfo: seq_len, rope_theta, global batch, number
of batches) and held-out evaluation batches per source. Batches are dicts of numpy [B/n, L]
arrays: inputs, targets, segment_ids, positions (int32), loss_mask (float32), rows
[p*B/n, (p+1)*B/n) of the global batch for process p of n.

Synthetic data (train.data='synthetic'; configs/tiny.py, configs/bench_small.py): batch k is a
function of (seed, k) only; held-out batches use another seed. Rows follow train.objective:
  lm    packed documents of random tokens in which a random motif of 4-16 tokens repeats, so a
        model can learn to copy it and the loss falls
  sft   the same packing of conversations: a random motif (the prompt, unsupervised) then its
        repetition (the answer, loss_mask 1 on its targets), as chat rows are
  dpo   preference pairs packed as the pipeline packs them: segment 2j-1 = prompt ++ chosen,
        2j = prompt ++ rejected (positions restart in each; loss_mask 1 on completion targets),
        where the prompt is a random motif, chosen repeats it and rejected is random tokens

A GRPO run (train.objective='grpo') samples its batches from the policy itself
(train/grpo_batches.py: prompts, completions, rewards, advantages); its held-out score is by
generation (GRPOBatches.evaluate), not held-out batches.

A vision-language run (a vision section) reads image_chat sources: its rows (and batches) also
hold the images' patches (data.vision.image_rows.ImageChatRows of the tower and train.patch_capacity),
the training rows' images augmented by train.augment_* (vision/augment.py), the held-out ones not.
"""

from __future__ import annotations

import copy
from typing import Any

import grain
import jax
import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data.curriculum import PhaseInfo
from zaya_jax.data.pipeline import foreign_state
from zaya_jax.parallel.distributed import local_batch_rows
from zaya_jax.train.objectives import DATA_KIND
from zaya_jax.train.settings import Settings

FIRST_TOKEN = 3  # ids below are pad / eos / bos in every shipped config
EVAL_SEED_OFFSET = 1_000_003


def synthetic_row(rng: np.random.Generator, seq_len: int, vocab: int, chat: bool = False) -> dict[str, np.ndarray]:
    """One packed row of [seq_len] arrays: documents of a repeated random motif; chat: only the
    targets after a document's first motif (its answer) are supervised."""
    tokens, segments, positions, supervised = [], [], [], []
    segment = 0
    while len(tokens) < seq_len + 1:
        segment += 1
        motif = rng.integers(FIRST_TOKEN, vocab, rng.integers(4, 17))
        length = int(rng.integers(seq_len // 4, seq_len + 2))
        doc = np.resize(motif, length)
        tokens.extend(doc)
        segments.extend([segment] * length)
        positions.extend(range(length))
        supervised.extend(np.arange(length) >= (len(motif) if chat else 0))
    tokens, segments = np.asarray(tokens[:seq_len + 1]), np.asarray(segments[:seq_len + 1])
    same_doc = segments[1:] == segments[:-1]
    return {"inputs": tokens[:-1].astype(np.int32), "targets": tokens[1:].astype(np.int32),
            "segment_ids": segments[:-1].astype(np.int32), "positions": np.asarray(positions[:seq_len], np.int32),
            "loss_mask": (same_doc & np.asarray(supervised[1:seq_len + 1])).astype(np.float32)}


def synthetic_preference_row(rng: np.random.Generator, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
    """One row of [seq_len] arrays packing preference pairs (at least one; none split); the rest is
    padding (segment 0, loss_mask 0)."""
    row = {k: np.zeros(seq_len, np.float32 if k == "loss_mask" else np.int32)
           for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    used, segment = 0, 0
    longest_prompt = max(2, min(16, seq_len // 4))
    while True:
        prompt = rng.integers(FIRST_TOKEN, vocab, rng.integers(2, longest_prompt + 1))
        chosen, rejected = prompt.copy(), rng.integers(FIRST_TOKEN, vocab, len(prompt))
        n = 2 * len(prompt) - 1  # inputs of one sequence: prompt ++ completion, shifted by one
        if used + 2 * n > seq_len:
            return row
        for completion in (chosen, rejected):
            sequence = np.concatenate([prompt, completion])
            segment += 1
            span = slice(used, used + n)
            row["inputs"][span], row["targets"][span] = sequence[:-1], sequence[1:]
            row["segment_ids"][span], row["positions"][span] = segment, np.arange(n)
            row["loss_mask"][span] = np.arange(1, n + 1) >= len(prompt)
            used += n


def synthetic_batch(seed: int, index: int, batch: int, seq_len: int, vocab: int, rows: slice,
                    objective: str = "lm") -> dict:
    rng = np.random.default_rng([seed, index])
    if objective == "dpo":
        all_rows = [synthetic_preference_row(rng, seq_len, vocab) for _ in range(batch)][rows]
    else:
        all_rows = [synthetic_row(rng, seq_len, vocab, chat=objective == "sft") for _ in range(batch)][rows]
    return {k: np.stack([r[k] for r in all_rows]) for k in all_rows[0]}


class SyntheticIterator(grain.DatasetIterator):
    """Synthetic global batches (this process's rows), without end; state: the next batch index."""

    chat_template = None  # (DataPipeline's: the template of chat sources)

    def __init__(self, phase: PhaseInfo, vocab: int, seed: int, objective: str = "lm"):
        super().__init__()
        self.phase, self.vocab_size, self.objective = phase, vocab, objective
        self._seed, self._index = seed, 0
        self._rows = local_batch_rows(phase.global_batch_size)

    def __next__(self) -> dict[str, np.ndarray]:
        self._index += 1
        return synthetic_batch(self._seed, self._index - 1, self.phase.global_batch_size, self.phase.seq_len,
                               self.vocab_size, self._rows, self.objective)

    def get_state(self) -> dict[str, Any]:
        return {"synthetic_batch": self._index}

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """Why this iterator cannot continue from `state` (a saved get_state()), or None."""
        return None if "synthetic_batch" in state else foreign_state(state, "synthetic data iterator")

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
    if settings.train.data == "synthetic" or settings.train.objective == "grpo":
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
    data.phases[-1]["token_budget"] = (last.num_batches + extra) * last.tokens_per_batch  # a ConfigDict or a dict
    return data


def phases_of(config, settings: Settings) -> tuple[PhaseInfo, ...]:
    """The phases (the last one extended to train.steps), validated without opening any file
    (ConfigError naming the field)."""
    if settings.train.objective == "grpo":
        from zaya_jax.train.grpo_batches import grpo_phase
        return (grpo_phase(settings),)
    if settings.train.data == "synthetic":
        return (synthetic_phase(settings),)
    from zaya_jax.data.curriculum import parse_phases
    return parse_phases(training_data_config(config, settings), process_count=jax.process_count())


def image_rows(settings: Settings):
    """The RowFormat of a vision-language run's image_chat rows (training images augmented as the
    train section says), or None for a text model."""
    if settings.vision is None:
        return None
    from zaya_jax.data.vision.augment import ImageAugment
    from zaya_jax.data.vision.image_rows import ImageChatRows
    t = settings.train
    return ImageChatRows(settings.vision[0], t.patch_capacity,
                         ImageAugment(t.augment_shift, t.augment_scale, t.augment_contrast))


def wanted_kind(settings: Settings) -> str:
    """The prepared-source kind a run reads: its objective's, or image_chat for a vision model."""
    return "image_chat" if settings.vision is not None else DATA_KIND[settings.train.objective]


def open_training_data(config, settings: Settings, tokenizer_file: str | None = None) -> grain.DatasetIterator:
    """The training iterator; opening a missing source fails naming the field and path.
    `tokenizer_file`: the run's tokenizer (start_checks.run_tokenizer), which GRPO encodes its prompts with."""
    if settings.train.objective == "grpo":
        from zaya_jax.train.grpo_batches import open_grpo_data
        return open_grpo_data(config, settings, tokenizer_file)
    if settings.train.data == "synthetic":
        return SyntheticIterator(synthetic_phase(settings), settings.model.vocab_size, settings.train.seed,
                                 settings.train.objective)
    from zaya_jax.data import build_pipeline
    pipeline = build_pipeline(training_data_config(config, settings), process_index=jax.process_index(),
                              process_count=jax.process_count(), seed=settings.train.seed,
                              image_rows=image_rows(settings))
    if pipeline.vocab_size > settings.model.vocab_size:
        raise ConfigError(f"data.sources were tokenized with a vocabulary of {pipeline.vocab_size}, larger than "
                         f"model.vocab_size={settings.model.vocab_size}")
    check_data_kind(settings.train.objective, pipeline.kind, sorted(config.data.sources),
                    pipeline.close, wanted_kind(settings))
    return pipeline


def check_data_kind(objective: str, kind: str, sources: list[str], close=lambda: None, wanted: str = "") -> None:
    """The prepared sources' kind must be `wanted` (default: the one train.objective reads; ConfigError
    naming the fix)."""
    wanted = wanted or DATA_KIND[objective]
    if kind != wanted:
        close()
        fix = {"text": "python -m zaya_jax.data.prepare (plain text)",
               "chat": "python -m zaya_jax.data.prepare --kind chat",
               "preference": "python -m zaya_jax.data.prepare --kind preference",
               "image_chat": "zaya_jax.data.prepare.write_tokenized(..., kind='image_chat') of "
                             "zaya_jax.data.vision.chat.encode_image_chat's documents (docs/vision.md)"}[wanted]
        objective_for = {v: k for k, v in DATA_KIND.items()}.get(kind) if wanted != "image_chat" else None
        reader = "a vision-language run" if wanted == "image_chat" else f"train.objective={objective!r}"
        raise ConfigError(f"{reader} reads {wanted} data, but data.sources "
                          f"({', '.join(sources)}) hold {kind} documents: prepare them with {fix}"
                          + (f", or set --config.train.objective={objective_for}" if objective_for else ""))


def eval_batches(config, settings: Settings) -> dict[str, list[dict[str, np.ndarray]]]:
    """{source: [batch, ...]} of held-out batches (this process's rows; none for GRPO)."""
    if settings.train.objective == "grpo":
        return {}
    max_batches = settings.eval.max_batches or None
    if settings.train.data == "synthetic":
        t = settings.train
        rows = local_batch_rows(t.global_batch_size)
        return {"synthetic": [synthetic_batch(t.seed + EVAL_SEED_OFFSET, i, t.global_batch_size, t.seq_len,
                                              settings.model.vocab_size, rows, t.objective)
                              for i in range(max_batches or 4)]}
    from zaya_jax.data import build_eval_batches
    return build_eval_batches(config.data, max_batches=max_batches, process_index=jax.process_index(),
                              process_count=jax.process_count(), image_rows=image_rows(settings))


def phase_at_step(phases: tuple[PhaseInfo, ...], step: int) -> PhaseInfo:
    """The phase whose batches include global batch number `step` (the last phase past the end)."""
    for phase in phases:
        if step < phase.num_batches:
            return phase
        step -= phase.num_batches
    return phases[-1]
