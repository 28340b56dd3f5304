"""The serving engine: continuous batching over a fixed number of decode slots, in process.

Shapes: N = `slots` rows of one DecodeState of T = `cache_size` slots each, C = `chunk`.

A request (prompt ids, SamplingParams) waits until a slot is free, then joins it: its longest
cached prefix (prefix_cache.py) is restored into the slot in one call, and the rest of its prompt is
prefilled C tokens per engine step (at most `prefill_budget` tokens a step over all slots, the
earliest admitted first, each slot's share ending on a block boundary). Each `step()` runs one
compiled call (step.py). While a slot is prefilling, it is `engine_chunk`: the slots still
prefilling extended by their share each (a prompt's last chunk also samples its first token),
and in the same pass over the layers one decode step of every slot that has a token to feed, the
MoE running over both groups' tokens at once, so each layer's experts are read once for the
two. Its chunk rows are the prefilling slots gathered into the smallest of `row_buckets` (1, 2,
4, ... and N; padded with other slots, which sit it out), so one arriving prompt costs a [1,C]
extend, not [N,C]. Otherwise it is `engine_decode` for every slot that has a token to feed (idle
slots sit it out: count 0): up to `decode_block` steps on the device, each slot stopping on its
stop ids or max_tokens there, a block of k tokens per host round trip. A request's `stop`
predicate (a stop string) and stop ids beyond step.STOP_IDS are checked on the host, token by
token in order, after the block: the tokens its slot made past the stop are dropped (the slot is
free, and the next request's prefill starts it over). So the engine compiles
`engine_chunk` once per row bucket, `engine_decode` and `snapshot` once each, `restore` once per
bucket of hit lengths (prefix_cache.restore_buckets: a hit is one call), and nothing after
warm-up. A response ends on a stop id (eos unless ignore_eos, and the request's stop_ids), max_tokens, the request's `stop` predicate, or `cancel`; its slot is free at once (a
request waiting for a slot while a decode block runs is admitted after it). A request whose callback or stop predicate raises ends with
reason "error" (the exception is logged) and the others go on.

Each new token goes as a TokenEvent to the request's queue and its `on_token` callback (either
optional, given to `submit`), from the thread running `step()`; a final Finished closes the queue.
`submit`, `cancel`, `stats` and `step` are thread-safe; `start()` runs `step()` on a background
thread while there is work.

A ZAYA1-VL model (ZayaVL) also takes requests with images (`submit(..., images=[...])`, the prompt
holding each image's expanded span as generate takes it): such a request is prefilled whole and
alone when it is admitted, its vision tower in that call (images.py: one compilation per prompt
width and patch bucket), skips the prefix cache, and then decodes among the others as text. On a
mesh the tower's weights are placed by the trainer's rules as the text model's are.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from typing import Callable, NamedTuple

import jax
import numpy as np
from flax import nnx

from zaya_jax.data.vision.processor import ImageProcessor, image_span
from zaya_jax.engine.images import fill_test_image, image_inputs, prefill_with_images, vision_split
from zaya_jax.engine.params import SamplingParams
from zaya_jax.engine.placement import place, place_params, row_buckets
from zaya_jax.engine.prefix_cache import PrefixCache, block_keys, bucketed, restore, restore_buckets, snapshot
from zaya_jax.engine.step import STOP_IDS, Decoded, Picked, RowSampling, engine_chunk, engine_decode
from zaya_jax.errors import UserError
from zaya_jax.infer.cache import empty_state
from zaya_jax.infer.static_loop import new_token_room
from zaya_jax.model.vision.vl import ImageBatch, ZayaVL, is_vision_language, text_model
from zaya_jax.model.zaya import ZayaLM


class TokenEvent(NamedTuple):
    token: int
    logprob: float | None                  # with params.logprobs
    top_logprobs: list[tuple[int, float]]  # params.top_logprobs best (token, logprob), best first


class Finished(NamedTuple):
    reason: str  # "stop" (a stop id or the stop predicate), "length" (max_tokens), "cancelled", or "error"
    #              (its on_token callback or stop predicate raised; logged, the other requests go on)
    tokens: list[int]
    logprobs: list[float]


@dataclasses.dataclass
class _Request:
    id: int
    prompt: np.ndarray            # [S] int32
    params: SamplingParams
    stops: frozenset[int]
    on_token: Callable[[int, TokenEvent], None] | None
    events: queue.Queue | None
    prefilled: int = 0            # prompt tokens in the slot's state
    blocks: list[bytes] = dataclasses.field(default_factory=list)  # the prompt's block keys (prefix cache)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    padded: np.ndarray | None = None     # with images: the prompt right-padded, [1,S] int32
    images: ImageBatch | None = None     # with images: their patches, [1,P,...] (prefilled whole, alone)


class Engine:
    def __init__(self, model: ZayaLM | ZayaVL, *, slots: int, cache_size: int, chunk: int, prefix_cache_bytes: int = 0,
                 max_top_logprobs: int = 5, image_processor: ImageProcessor | None = None,
                 mesh: jax.sharding.Mesh | None = None, decode_block: int = 8, prefill_budget: int | None = None):
        """model: a ZayaLM, or a ZayaVL (then requests may carry images); slots: N decode rows;
        cache_size: T positions per row; chunk: C prompt tokens per row and step (also the prefix
        cache's block); prefix_cache_bytes: its budget (0: off); max_top_logprobs: the most
        top_logprobs a request may ask for (one compiled size); image_processor: how a ZayaVL's
        images are resized and cut (default: ImageProcessor.for_tower, Qwen2-VL's sizes);
        mesh: None (one device) or a mesh with the trainer's axes (parallel.mesh.make_mesh): weights
        sharded by the trainer's rules (a ZayaVL's tower too), slots split over data, every
        compiled call sharded (zaya_jax.engine.placement; a mesh the model cannot use is a
        ConfigError here); decode_block: k, the most decode steps one compiled call runs (1: a host
        round trip per token); prefill_budget: the most prompt tokens one step prefills, all slots
        together (None: C per prefilling slot), given to the earliest admitted first, each up to its
        next block boundary, so a burst of prompts cannot make a step, and the running streams'
        next token, wait for N x C tokens of prefill."""
        self.config = text_model(model).config
        self._graphdef, self._params = nnx.split(text_model(model))
        self._vl = model if is_vision_language(model) else None
        self.image_ids = None if self._vl is None else model.ids  # ImageTokenIds, None for a text model
        self.image_processor = None if self._vl is None else (
            image_processor or ImageProcessor.for_tower(model.vision.config))
        self.slots, self.cache_size, self.chunk, self.max_top_logprobs = slots, cache_size, chunk, max_top_logprobs
        self.mesh = mesh
        self._state = empty_state(self.config, slots, cache_size)
        if not isinstance(decode_block, int) or decode_block < 1:
            raise ValueError(f"decode_block must be a positive integer, got {decode_block!r}")
        self.decode_block = decode_block
        if prefill_budget is not None and (not isinstance(prefill_budget, int) or prefill_budget < 1):
            raise ValueError(f"prefill_budget must be a positive integer (prompt tokens per step) or None, "
                             f"got {prefill_budget!r}")
        self.prefill_budget = slots * chunk if prefill_budget is None else prefill_budget
        self.row_buckets = row_buckets(slots, mesh)
        self.restore_buckets = restore_buckets(cache_size, chunk)  # entries a prefix hit restores in one call
        self._chunk, self._decode, self._snapshot, self._restore = engine_chunk, engine_decode, snapshot, restore
        self._images = prefill_with_images
        if mesh is not None:
            (self._params, self._state, self._chunk, self._decode, self._snapshot, self._restore,
             self._images) = place(model, self._params, self._state, mesh, slots)
        self._vision = None if self._vl is None else self._place_vision(model)  # (graphdef, tower params)
        self.calls = collections.Counter()  # compiled calls run: ("chunk", B), ("decode", steps asked), ("restore", b)
        self._prefix = PrefixCache(chunk, prefix_cache_bytes) if prefix_cache_bytes else None
        self._rows: list[_Request | None] = [None] * slots
        self._waiting: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._callers = 0  # threads waiting in _callers_turn for the lock (counted under _callers_in)
        self._callers_in = threading.Condition(threading.Lock())  # notified when the last of them has it
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._prompt_tokens = self._generated_tokens = 0

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, prompt_ids, params: SamplingParams = SamplingParams(), *, events: queue.Queue | None = None,
               on_token: Callable[[int, TokenEvent], None] | None = None, images=None) -> int:
        """-> the request id. Its TokenEvents, then one Finished, go to `events` and each TokenEvent
        to on_token(id, event). ValueError, before anything runs, for bad params or a prompt that
        does not fit: prompt + max_tokens - 1 positions must fit cache_size (the last token is
        never fed). images (a ZayaVL's engine only): uint8 [H, W(, C)] arrays or Pillow images in
        the order of the prompt's image spans (zaya_jax.data.vision.prompts.expand_placeholders); their
        placeholders must number their tokens, and a prompt without images holds none (ValueError)."""
        cfg = self.config
        params.validate(cfg.vocab_size, self.max_top_logprobs)
        prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
        if prompt.size == 0 or prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
            raise ValueError(f"the prompt needs at least one token, all in the vocabulary [0, {cfg.vocab_size})")
        over = params.max_tokens - new_token_room(prompt.size, self.cache_size)
        needed = prompt.size + params.max_tokens - 1
        if over > 0:
            raise ValueError(f"prompt of {prompt.size} tokens + max_tokens {params.max_tokens} needs {needed} "
                             f"positions, {over} more than cache_size={self.cache_size}: "
                             f"shorten the prompt or lower max_tokens by {over}")
        if cfg.position_limit is not None and params.max_tokens > new_token_room(prompt.size, cfg.position_limit):
            raise ValueError(f"prompt + max_tokens needs {needed} positions, more than the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        stops = frozenset(map(int, params.stop_ids)) | (frozenset() if params.ignore_eos else {cfg.eos_token_id})
        padded, batch = None, None
        if self._vl is not None:
            try:
                padded, batch = image_inputs(self._vl, prompt, images, self.image_processor, self.cache_size)
            except UserError as err:
                raise ValueError(str(err)) from None
        elif images:
            raise ValueError("images need a vision-language model (a ZayaVL); this engine serves a text model")
        with self._callers_turn():
            request = _Request(next(self._ids), prompt.astype(np.int32), params, stops, on_token, events,
                               padded=padded, images=batch)
            self._waiting.append(request)
            self._work.notify()
        return request.id

    def cancel(self, request_id: int) -> bool:
        """End a waiting or running request now (its slot is free for the next step) -> whether it was found."""
        with self._callers_turn():
            for r in self._waiting:
                if r.id == request_id:
                    self._waiting.remove(r)
                    self._deliver(r, Finished("cancelled", [], []))
                    return True
            for slot, r in enumerate(self._rows):
                if r is not None and r.id == request_id:
                    self._finish(slot, "cancelled")
                    return True
        return False

    def stats(self) -> dict:
        """waiting, running, free_slots, prompt_tokens (prefilled), generated_tokens, and the prefix
        cache's hits, misses (per admitted request), tokens_reused, entries, bytes and evictions."""
        with self._callers_turn():
            running = sum(r is not None for r in self._rows)
            prefix = (self._prefix or PrefixCache(self.chunk, 0)).stats()  # all 0 without a prefix cache
            return dict(waiting=len(self._waiting), running=running, free_slots=self.slots - running,
                        prompt_tokens=self._prompt_tokens, generated_tokens=self._generated_tokens, **prefix)

    def set_weights(self, model: ZayaLM | ZayaVL) -> None:
        """Serve `model`'s weights from the next step on, placed as the engine placed its first (as
        they are, or on its mesh by the trainer's rules), so nothing recompiles: a model of the engine's
        architecture (its graph equal to the engine's; ValueError otherwise), on an idle engine
        (RuntimeError otherwise: a running response would mix two models' tokens). The prefix
        cache is emptied (its entries hold the old weights' keys and values)."""
        graphdef, params = nnx.split(text_model(model))
        if graphdef != self._graphdef or is_vision_language(model) != (self._vl is not None) or (
                self._vl is not None and nnx.graphdef(model) != self._vision[0]):
            raise ValueError("set_weights needs a model of the engine's architecture (an equal graph: same config "
                             "and layers); build a new Engine for another model")
        with self._callers_turn():
            if self.has_work():
                raise RuntimeError("set_weights() runs on an idle engine: requests are running or waiting")
            self._params = params if self.mesh is None else place_params(params, self.mesh)
            if self._vl is not None:
                self._vl, self._vision = model, self._place_vision(model)
            if self._prefix is not None:
                self._prefix = PrefixCache(self.chunk, self._prefix.budget)

    def slot_bytes(self) -> int:
        """Bytes of one slot's decode state (keys, values, rings, carry, length)."""
        return sum(x.nbytes for x in jax.tree.leaves(self._state)) // self.slots

    def warm_up(self, image_sizes: tuple[tuple[int, int], ...] = ()) -> None:
        """Compiles every program serving runs (the chunk call at every row bucket, the decode
        block, the prefix cache's snapshot and its restore at every bucket of hit lengths) on two
        throwaway requests, then forgets them (their cache entries and token counts are not kept): nothing compiles after this for text requests. Call it
        before start(). image_sizes (a ZayaVL's engine): for each (height, width), a request of bos
        and one grey image of that size compiles the image prefill of its patch and prompt-width
        buckets (a longer prompt around the image may fall in a later width bucket, compiled on
        first use)."""
        with self._lock:
            if self.has_work():
                raise RuntimeError("warm_up() runs on an idle engine, before start()")
            if image_sizes and self._vl is None:
                raise ValueError("warm_up(image_sizes=...) needs a vision-language model (a ZayaVL)")
            kept, counts = self._prefix, (self._prompt_tokens, self._generated_tokens)
            if kept is not None:
                self._prefix = PrefixCache(self.chunk, kept.budget)
            prompt = np.full(min(self.chunk + 1, self.cache_size - 1), self.config.bos_token_id)
            for _ in range(2):  # the second restores the block the first stored
                self.submit(prompt, SamplingParams(max_tokens=2))
                while self.has_work():
                    self.step()
            for rows in self.row_buckets:  # the buckets two requests did not use: every row sits out
                self._run_chunk(list(range(rows)), {}, [])
            if kept is not None and self.restore_buckets:  # each hit length's restore, into free slot 0
                entry = self._snapshot(self._state, np.int32(0), np.int32(0), block=self.chunk)
                for b in self.restore_buckets:
                    self._state = self._restore(self._state, np.int32(0), np.zeros(b, np.int32), (entry,) * b)
            for height, width in image_sizes:
                image = fill_test_image(height, width)
                span = image_span(self.image_processor.grid(image), *self.image_ids, self.image_processor.merge_size)
                self.submit([self.config.bos_token_id, *span], SamplingParams(max_tokens=2), images=[image])
                while self.has_work():
                    self.step()
            self._prefix, (self._prompt_tokens, self._generated_tokens) = kept, counts
            self.calls.clear()

    def devices(self) -> list[jax.Device]:
        """The devices holding the engine's weights and decode state (one without a mesh), by id."""
        held = {d for x in jax.tree.leaves((self._params, self._state)) if isinstance(x, jax.Array)
                for d in x.sharding.device_set}
        return sorted(held, key=lambda d: d.id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting) or any(r is not None for r in self._rows)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine iteration: admit waiting requests into free slots; then, while a slot is
        prefilling, one prefill chunk of its share with one decode step of every slot with a token
        to feed, in one call; otherwise a decode block."""
        with self._lock:
            self._admit()
            for slot, r in enumerate(self._rows):
                if r is not None and r.images is not None and r.prefilled == 0:
                    self._prefill_images(slot, r)
            prefilling = self._prefill_shares()
            feeding = [slot for slot, r in enumerate(self._rows) if r is not None and r.tokens]
            if prefilling:
                rows = next(b for b in self.row_buckets if b >= len(prefilling))
                order = sorted(prefilling) + [s for s in range(self.slots) if s not in prefilling]
                self._run_chunk(order[:rows] if rows < self.slots else list(range(self.slots)), prefilling, feeding)
            elif feeding:
                self._run_decode(feeding)

    def start(self) -> None:
        """Run step() on a background thread whenever there is work, until stop()."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="zaya-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.has_work():
                    self._work.wait()
                if self._stopping:
                    return
            self.step()
            with self._callers_in:  # their turn first: a lock is not fair, and the loop would take
                self._callers_in.wait_for(lambda: not self._callers)  # it back before a woken caller ran

    @contextlib.contextmanager
    def _callers_turn(self):
        """The engine's lock for submit, cancel, stats and set_weights, taken between two steps: the
        background loop waits while a caller waits for it (without this, a loop that is never idle
        kept the lock from callers: the server's requests and metrics stalled until the engine idled)."""
        with self._callers_in:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._callers_in:
                self._callers -= 1
                if not self._callers:
                    self._callers_in.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    # ---- inside a step --------------------------------------------------------------------------
    def _admit(self) -> None:
        for slot in range(self.slots):
            if self._rows[slot] is None and self._waiting:
                r = self._waiting.popleft()
                self._rows[slot] = r
                if self._prefix is None or r.images is not None:  # an image's keys are not the prompt's ids'
                    continue
                r.blocks = block_keys(r.prompt, self.chunk)
                found = self._prefix.lookup(r.prompt, r.blocks)
                if found:
                    starts, entries = bucketed(found, self.chunk, self.restore_buckets)
                    self.calls["restore", len(entries)] += 1
                    self._state = self._restore(self._state, np.int32(slot), starts, entries)
                    r.prefilled = len(found) * self.chunk

    def _prefill_shares(self) -> dict[int, int]:
        """slot -> the prompt tokens it prefills this step: the slots still prefilling, earliest
        admitted first, each up to its next block boundary (a multiple of C, or its prompt's end),
        until prefill_budget is spent."""
        left, shares = self.prefill_budget, {}
        waiting = [(r.id, slot) for slot, r in enumerate(self._rows) if r is not None and r.prefilled < r.prompt.size]
        for _, slot in sorted(waiting):
            r = self._rows[slot]
            shares[slot] = min(self.chunk - r.prefilled % self.chunk, r.prompt.size - r.prefilled, left)
            left -= shares[slot]
            if not left:
                break
        return shares

    def _lengths(self) -> np.ndarray:
        """[N] tokens each slot's state holds (0 for a free slot)."""
        return np.array([0 if r is None else r.prefilled + max(len(r.tokens) - 1, 0) for r in self._rows], np.int32)

    def _run_chunk(self, order: list[int], prefilling: dict[int, int], feeding: list[int]) -> None:
        """One engine_chunk over the slots in `order` (a row bucket's worth; all N in slot order
        run without a gather), each slot of `prefilling` (slot -> its new prompt tokens) taking
        its next tokens, the others sitting out, and in the same pass one decode step of the
        `feeding` slots; then the bookkeeping, each finished prompt's first token and each decoded
        slot's next."""
        rows = len(order)
        ids, counts = np.zeros((rows, self.chunk), np.int32), np.zeros(rows, np.int32)
        requests = {slot: self._rows[slot] for slot in prefilling}
        for i, slot in enumerate(order):
            if slot in requests:
                r, counts[i] = requests[slot], prefilling[slot]
                ids[i, :counts[i]] = r.prompt[r.prefilled:r.prefilled + counts[i]]
        decoding = {slot: self._rows[slot] for slot in feeding}
        feed, fed = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        for slot, r in decoding.items():
            feed[slot], fed[slot] = r.tokens[-1], 1
        self.calls["chunk", rows] += 1
        self._state, picked, decoded = self._chunk(
            self._graphdef, self._params, self._state, None if rows == self.slots else np.asarray(order, np.int32),
            self._lengths(), ids, counts, self._row_sampling([requests.get(slot) for slot in order]), feed, fed,
            self._row_sampling([decoding.get(slot) for slot in range(self.slots)]), top=max(self.max_top_logprobs, 1))
        picked, decoded = Picked(*jax.device_get(picked)), Picked(*jax.device_get(decoded))
        for i, slot in enumerate(order):
            r = requests.get(slot)
            if r is None or self._rows[slot] is not r:  # an on_token callback may cancel another
                continue
            r.prefilled += prefilling[slot]
            self._prompt_tokens += prefilling[slot]
            self._store_prefix(slot, r)
            if r.prefilled == r.prompt.size:
                self._emit(slot, r, picked, i)
        for slot, r in decoding.items():
            if self._rows[slot] is r:
                self._emit(slot, r, decoded, slot)

    def _run_decode(self, feeding: list[int]) -> None:
        """One engine_decode for the `feeding` slots: up to decode_block steps; then each token in
        order, step by step, slot by slot, until a request ends (a stop its host checks: the rest
        of its slot's tokens are dropped)."""
        requests = {slot: self._rows[slot] for slot in feeding}
        tokens, budget = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        stop_ids = np.full((self.slots, STOP_IDS), -1, np.int32)
        for slot, r in requests.items():
            tokens[slot], budget[slot] = r.tokens[-1], r.params.max_tokens - len(r.tokens)
            stop_ids[slot, :min(len(r.stops), STOP_IDS)] = sorted(r.stops)[:STOP_IDS]
        steps = min(self.decode_block, int(budget.max()))
        self.calls["decode", steps] += 1
        self._state, decoded = self._decode(self._graphdef, self._params, self._state, self._lengths(), tokens,
                                            np.minimum(budget, steps), stop_ids,
                                            self._row_sampling([requests.get(slot) for slot in range(self.slots)]),
                                            np.int32(steps), top=max(self.max_top_logprobs, 1),
                                            block=self.decode_block)
        decoded = Decoded(Picked(*jax.device_get(decoded.picked)), np.asarray(decoded.made))
        for i in range(int(decoded.made.max())):
            step = Picked(*(x[i] for x in decoded.picked))
            for slot, r in requests.items():
                if i < decoded.made[slot] and self._rows[slot] is r:
                    self._emit(slot, r, step, slot)

    def _row_sampling(self, requests: list[_Request | None]) -> RowSampling:
        """Each row's sampling settings, [len(requests)] arrays (defaults where a row has no request)."""
        rows = len(requests)
        sampling = RowSampling(np.zeros(rows, np.float32), np.full(rows, self.config.vocab_size, np.int32),
                               np.ones(rows, np.float32), np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                               np.zeros(rows, np.int32))
        for i, r in enumerate(requests):
            if r is None:
                continue
            p = r.params
            sampling.temperature[i], sampling.seed[i], sampling.index[i] = p.temperature, p.seed, len(r.tokens)
            sampling.top_k[i] = p.top_k or self.config.vocab_size
            sampling.top_p[i] = 1.0 if p.top_p is None else p.top_p
            sampling.top_logprobs[i] = p.top_logprobs
        return sampling

    def _prefill_images(self, slot: int, r: _Request) -> None:
        """Prefill a request with images whole, alone, into its slot's row (images.py), and emit its
        first token."""
        rows = self._row_sampling([r])
        self._state, picked = self._images(*self._vision, self._params, self._state, np.int32(slot), r.padded,
                                           np.asarray([r.prompt.size], np.int32), r.images, rows,
                                           top=max(self.max_top_logprobs, 1), copies=self.row_buckets[0])
        r.prefilled = r.prompt.size
        self._prompt_tokens += r.prompt.size
        self._emit(slot, r, Picked(*jax.device_get(picked)), 0)

    def _place_vision(self, model: ZayaVL) -> tuple[nnx.GraphDef, nnx.State]:
        """A ZayaVL's vision_split, its tower's weights on the engine's mesh (as they are without one)."""
        graphdef, tower = vision_split(model)
        return graphdef, tower if self.mesh is None else place_params(tower, self.mesh)

    def _store_prefix(self, slot: int, r: _Request) -> None:
        if self._prefix is not None and self._prefix.wants(r.blocks, r.prefilled):
            entry = self._snapshot(self._state, np.int32(slot), np.int32(r.prefilled - self.chunk), block=self.chunk)
            self._prefix.insert(r.prompt, r.blocks, r.prefilled, entry)

    def _emit(self, slot: int, r: _Request, picked: Picked, row: int) -> None:
        """Deliver row `row` of numpy `picked` as slot's next token and end its request if it stops."""
        token = int(picked.token[row])
        r.tokens.append(token)
        r.logprobs.append(float(picked.logprob[row]))
        self._generated_tokens += 1
        top = [(int(t), float(lp)) for t, lp in zip(picked.top_tokens[row, :r.params.top_logprobs],
                                                     picked.top_logprobs[row, :r.params.top_logprobs])]
        event = TokenEvent(token, r.logprobs[-1] if r.params.logprobs else None, top)
        self._deliver(r, event)
        try:
            if r.on_token is not None:
                r.on_token(r.id, event)
            stop = r.params.stop is not None and r.params.stop(list(r.tokens))
        except Exception:  # one request's hook must not stop the others
            logging.exception("request %d: its on_token callback or stop predicate raised; ending it", r.id)
            stop = None
        if self._rows[slot] is not r:  # the callback cancelled it
            return
        if stop is None:
            self._finish(slot, "error")
        elif token in r.stops or stop:
            self._finish(slot, "stop")
        elif len(r.tokens) == r.params.max_tokens:
            self._finish(slot, "length")

    def _finish(self, slot: int, reason: str) -> None:
        r, self._rows[slot] = self._rows[slot], None
        self._deliver(r, Finished(reason, r.tokens, r.logprobs if r.params.logprobs else []))

    @staticmethod
    def _deliver(r: _Request, event: TokenEvent | Finished) -> None:
        if r.events is not None:
            r.events.put(event)
