"""The library's `generate` (`from zaya_jax.engine import generate`), and a whole list of prompts
through the engine, run to the end on the calling thread.

`generate` chooses: the static loop (zaya_jax.infer.static_loop.generate_static) by default, or with
`slots` continuous batching for an offline batch (an evaluation set, GRPO's rollouts): every prompt
is submitted at once, the engine's `slots` rows take them in order, and a row that stops early (a
stop id) takes the next waiting prompt at the next step instead of idling until the batch's longest
completion is done, as the static loop's rows do.

  tokens, lengths = run_to_end(engine, prompts, [SamplingParams(...) per prompt])
  tokens = generate(model, prompts, max_new_tokens)            # the static loop
  tokens = generate(model, prompts, max_new_tokens, slots=8)   # an engine of 8 rows
"""

from __future__ import annotations

import queue
from typing import Sequence

import jax
import numpy as np

from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.engine.engine import Engine, Finished
from zaya_jax.engine.params import SamplingParams
from zaya_jax.infer.static_loop import generate_static, pad_prompts
from zaya_jax.model.vision.vl import text_model


def row_seed(seed: int, row: int) -> int:
    """Row `row`'s sampling seed in a generation seeded `seed`: SeedSequence([seed, row])'s first word."""
    return int(np.random.SeedSequence([seed, row]).generate_state(1)[0])


def last_event(events: queue.Queue) -> Finished:
    """A finished request's Finished (its queue's last event), after its TokenEvents."""
    while not isinstance(event := events.get_nowait(), Finished):
        pass
    return event


def batch_engine(model, slots: int, prompt_width: int, max_new_tokens: int, *, chunk: int | None = None,
                 mesh: jax.sharding.Mesh | None = None, image_processor: ImageProcessor | None = None) -> Engine:
    """An engine for offline batches: `slots` rows of prompt_width + max_new_tokens - 1 positions,
    prompts prefilled `chunk` tokens a step (default prompt_width: one chunk), no top log-probs, on
    `mesh` (None: one device)."""
    return Engine(model, slots=slots, cache_size=prompt_width + max_new_tokens - 1, chunk=chunk or prompt_width,
                  max_top_logprobs=0, mesh=mesh, image_processor=image_processor)


def run_to_end(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               images: Sequence[Sequence] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every prompt with its SamplingParams (and images, a ZayaVL engine's) through `engine`, idle
    before and after -> (tokens int32 [B, max max_tokens], pad_token_id after each row's end;
    lengths int32 [B]). ValueError from Engine.submit, before anything runs, for a prompt or params
    the engine cannot take."""
    if engine.has_work():
        raise RuntimeError("run_to_end needs an idle engine: its steps run every request it holds")
    events = [queue.Queue() for _ in prompts]
    for i, (prompt, row_params, done) in enumerate(zip(prompts, params, events, strict=True)):
        engine.submit(prompt, row_params, events=done, images=None if images is None else images[i])
    while engine.has_work():
        engine.step()
    tokens = np.full((len(prompts), max(p.max_tokens for p in params)), engine.config.pad_token_id, np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    for i, done in enumerate(events):
        finished = last_event(done)
        tokens[i, :len(finished.tokens)] = finished.tokens
        lengths[i] = len(finished.tokens)
    return tokens, lengths


def generate_in_slots(model, prompt_ids, max_new_tokens: int, *, slots: int, chunk: int | None = None,
                      temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                      seed: int = 0, stop_at_eos: bool = True, stop_ids: Sequence[int] = (),
                      mesh: jax.sharding.Mesh | None = None, images: Sequence[Sequence] | None = None,
                      image_processor: ImageProcessor | None = None, on_token=None) -> np.ndarray:
    """generate's result (int32 [B, max_new_tokens], the stop token kept, pad_token_id
    after it) for `prompt_ids` (a list of token-id lists, or one flat list) from an engine of
    `slots` rows, each prompt prefilled `chunk` tokens a step (default: the longest prompt, one
    chunk). Greedy rows equal the static loop's; a sampled row draws with seed row_seed(seed, i),
    so it is what generate samples for that prompt alone with that seed (the static loop draws one
    stream for the whole batch). mesh: the engine's (placement.py). on_token is the static loop's
    (ValueError here)."""
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive integer, got {slots!r}")
    if on_token is not None:
        raise ValueError("on_token streams the static loop's columns; with slots, stream through "
                         "zaya_jax.engine.Engine.submit's on_token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    cfg = text_model(model).config
    ids, lengths = pad_prompts(prompt_ids, None, cfg.pad_token_id, cfg.vocab_size)
    prompts = [row[:n].tolist() for row, n in zip(ids, lengths)]
    engine = batch_engine(model, slots, max(len(p) for p in prompts), max_new_tokens, chunk=chunk, mesh=mesh,
                          image_processor=image_processor)
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=row_seed(seed, i), stop_ids=tuple(stop_ids) if stop_at_eos else (),
                             ignore_eos=not stop_at_eos) for i in range(len(prompts))]
    return run_to_end(engine, prompts, params, images)[0]


def generate(model, prompt_ids, max_new_tokens: int, *, slots: int | None = None, **options) -> np.ndarray:
    """The library's generate: new token ids after each prompt, int32 [B, max_new_tokens]. slots=None:
    one static batch (generate_static: every row decodes until the last one stops); slots=N:
    generate_in_slots, N engine rows each taking the next prompt as soon as its own stops, for many
    prompts whose completions end apart (greedy rows equal the static batch's; a sampled row i
    draws with seed row_seed(seed, i); no on_token, no padded-array `lengths`)."""
    if slots is None:
        return generate_static(model, prompt_ids, max_new_tokens, **options)
    return generate_in_slots(model, prompt_ids, max_new_tokens, slots=slots, **options)
