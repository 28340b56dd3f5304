"""What the server does with an OpenAI request: prompt ids, engine requests, response bodies.

    service = Service(engine, ServedModel(...), max_waiting=64)
    job = service.completion_job(CompletionRequest(...))        # or chat_job(ChatCompletionRequest)
    async for piece in service.run(job): ...                    # Piece per choice and token batch
    body = service.response(job, pieces)                        # the non-streaming JSON body

completion_job and chat_job tokenize the prompt (the app calls them on a worker thread, off the
event loop); a prompt text of more characters than the context's tokens can hold (the tokenizer's
longest token, Tokenizer.max_token_chars) is refused before it is tokenized.

A job is one request's n choices: n engine requests with the same prompt and the seeds seed,
seed + 1, ... (a request without a seed draws one), each with its ResponseText (stop strings,
detokenization). Events come from the engine's thread (its `events` queue argument, here an
object whose put() goes through the event loop's call_soon_threadsafe) into one asyncio queue per job. Leaving `run` early (the client went away,
the server is stopping) cancels the job's engine requests, so their slots are free at once.

With a vision-language engine (engine.image_ids set), a chat message's image_url parts (data: URLs
only, base64, as OpenAI's clients send them) are read as images at their place: the chat template's
IMAGE marker there, expanded to each image's span after rendering, and the images go with the
engine requests. A completion's prompt ids may not hold the image placeholder (images come through
chat only).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import io
import secrets
import time
from typing import AsyncIterator, NamedTuple

from zaya_jax.engine.engine import Engine, Finished, TokenEvent
from zaya_jax.engine.params import SamplingParams
from zaya_jax.infer.static_loop import new_token_room
from zaya_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from zaya_jax.serve.text import ResponseText


@dataclasses.dataclass
class ServedModel:
    """The model's name in the API, and how its prompts are written: tokenizer (zaya_jax.data.tokenizer.
    Tokenizer), chat template (None: /v1/chat/completions refused), its end-of-turn ids."""
    name: str
    tokenizer: object
    template: object | None
    end_of_turn: list[int]
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class Choice:
    index: int
    text: ResponseText
    request_id: int | None = None
    tokens: list[TokenEvent] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


@dataclasses.dataclass
class Job:
    kind: str                 # "completion" or "chat"
    id: str
    model: str
    prompt: list[int]
    params: list[SamplingParams]
    choices: list[Choice]
    logprobs: int | None      # None: no logprobs; else how many top alternatives per token
    include_usage: bool
    images: list = dataclasses.field(default_factory=list)  # Pillow images, in the order of the prompt's spans
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    last_token: float = 0.0   # when the last token came (time per output token)


class Piece(NamedTuple):
    """What one choice adds: new text, the tokens behind it, its finish reason once done."""
    index: int
    text: str
    tokens: list[TokenEvent]
    finish_reason: str | None


class Service:
    def __init__(self, engine: Engine, served: ServedModel, max_waiting: int, metrics=None):
        self.engine, self.served, self.max_waiting, self.metrics = engine, served, max_waiting, metrics
        self.token_chars = served.tokenizer.max_token_chars()  # None: a prompt's characters bound nothing

    # ---- requests -> jobs -----------------------------------------------------------------------
    def completion_job(self, request: CompletionRequest) -> Job:
        self._check_common(request)
        prompt = request.single_prompt()
        tok = self.served.tokenizer
        if isinstance(prompt, str):
            self._check_characters("completion", len(prompt))
            ids = [tok.bos_id] + tok.encode(prompt)
        else:
            vocab = self.engine.config.vocab_size
            outside = [i for i in prompt if not 0 <= i < vocab]
            if outside:
                raise APIError(400, f"prompt: token ids {outside[:5]} outside the vocabulary [0, {vocab})", "prompt")
            ids = list(prompt)
            image_ids = self.engine.image_ids
            if image_ids is not None and image_ids.image in ids:
                raise APIError(400, f"prompt: token id {image_ids.image} is the image placeholder; send images as "
                               "image_url parts to /v1/chat/completions", "prompt")
        return self._job("completion", "cmpl", request, ids, request.max_tokens, stop_ids=[],
                         logprobs=request.logprobs)

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self._check_common(request)
        if self.served.template is None:
            raise APIError(400, f"model {self.served.name} has no chat template: use /v1/completions, or start the "
                           "server with --chat_template FILE", "messages")
        from zaya_jax.data.chat_template import IMAGE, encode_prompt
        from zaya_jax.data.vision.prompts import expand_placeholders
        from zaya_jax.errors import UserError
        messages, images, image_ids = [], [], self.engine.image_ids
        for i, m in enumerate(request.messages):
            if isinstance(m.content, str):
                text = m.content
            else:
                if image_ids is None and any(part.type == "image_url" for part in m.content):
                    raise APIError(400, f"messages[{i}].content: image_url parts need a vision-language model; "
                                   f"{self.served.name} is text only", f"messages.{i}.content")
                parts = []
                for j, part in enumerate(m.content):
                    if part.type == "image_url":
                        images.append(self.read_image_url(part.image_url.url, i, j))
                    parts.append(IMAGE if part.type == "image_url" else part.text)
                text = "".join(parts)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        self._check_characters("chat", sum(len(m["content"]) for m in messages))
        try:
            ids = encode_prompt(self.served.template, self.served.tokenizer, messages,
                                None if image_ids is None else image_ids.image).tolist()
            if image_ids is not None:  # each image's one placeholder -> its span
                processor = self.engine.image_processor
                ids = expand_placeholders(ids, [processor.grid(image) for image in images], image_ids,
                                          processor.merge_size)
        except UserError as err:
            raise APIError(400, f"messages: {err}", "messages") from None
        return self._job("chat", "chatcmpl", request, ids, request.token_limit(), stop_ids=self.served.end_of_turn,
                         logprobs=(request.top_logprobs or 0) if request.logprobs else None, images=images)

    def read_image_url(self, url: str, i: int, j: int):
        """messages[i].content[j]'s image_url -> an RGB Pillow image; a 400 naming the part for a URL that
        is not a base64 data: URL (nothing is fetched from the network), bytes that are no image, or an
        image below the processor's minimum side."""
        from zaya_jax.data.vision.processor import read_image
        from zaya_jax.errors import UserError
        where, param = f"messages[{i}].content[{j}]", f"messages.{i}.content.{j}"
        header, comma, payload = url.partition(",")
        if not (header.startswith("data:") and header.endswith(";base64") and comma):
            raise APIError(400, f"{where}: image_url must be a base64 data: URL (data:image/png;base64,...); this "
                           f"server fetches nothing, got {url[:40]!r}", param)
        try:
            image = read_image(io.BytesIO(base64.b64decode(payload, validate=True)))
            self.engine.image_processor.size(image.height, image.width)
        except (binascii.Error, ValueError, UserError) as err:
            raise APIError(400, f"{where}: {err}", param) from None
        return image

    def _check_common(self, request: SamplingFields) -> None:
        if request.model != self.served.name:
            raise APIError(404, f"model {request.model!r} does not exist; this server serves {self.served.name!r} "
                           "(GET /v1/models)", "model", "model_not_found")
        request.refuse_unsupported()

    def _check_characters(self, kind: str, characters: int) -> None:
        """A prompt text of more characters than the context's tokens can hold is refused before it is
        tokenized (a multi-megabyte prompt would take seconds of tokenizing to be refused anyway)."""
        if self.token_chars is not None and characters > self.engine.cache_size * self.token_chars:
            raise self._over_long(kind, f"{characters} characters, more tokens ({self.token_chars} characters a "
                                        "token at most)")

    def _over_long(self, kind: str, size: str) -> APIError:
        context = self.engine.cache_size
        return APIError(400, f"the prompt is {size} than this server's context of {context} tokens allows (one new "
                        f"token needs a prompt of at most {context}); shorten it",
                        "messages" if kind == "chat" else "prompt", "context_length_exceeded")

    def _job(self, kind: str, prefix: str, request: SamplingFields, ids: list[int], max_tokens: int | None,
             stop_ids: list[int], logprobs: int | None, images: list = ()) -> Job:
        room = new_token_room(len(ids), self.engine.cache_size)
        if room < 1:
            raise self._over_long(kind, f"{len(ids)} tokens, {len(ids) - self.engine.cache_size} more")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens}: the {len(ids)}-token prompt leaves room for {room} new "
                           f"tokens in this server's context of {self.engine.cache_size}; ask for at most {room}",
                           "max_tokens", "context_length_exceeded")
        if logprobs is not None and logprobs > self.engine.max_top_logprobs:
            raise APIError(400, f"{'top_logprobs' if kind == 'chat' else 'logprobs'} {logprobs}: this server returns "
                           f"at most {self.engine.max_top_logprobs} alternatives per token",
                           "top_logprobs" if kind == "chat" else "logprobs")
        waiting = self.engine.stats()["waiting"]  # engine requests: each choice of a job is one
        if waiting + request.n > self.max_waiting:
            fix = (f"send n of at most {self.max_waiting}" if request.n > self.max_waiting else "retry later")
            raise APIError(429, f"the server's queue holds at most {self.max_waiting} sequences for a slot: {waiting} "
                           f"wait and this request's n={request.n} would pass that; {fix}",
                           None, "queue_full", kind="rate_limit_error")
        temperature = 1.0 if request.temperature is None else request.temperature
        seed = secrets.randbits(31) if request.seed is None else request.seed
        stops = request.stop_strings()
        texts = [ResponseText(self.served.tokenizer, stops, set(stop_ids)) for _ in range(request.n)]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 top_p=None if request.top_p in (None, 1.0) else request.top_p,
                                 top_k=None if request.top_k in (None, -1) else request.top_k,
                                 seed=(seed + i) % 2 ** 32, stop_ids=tuple(stop_ids), ignore_eos=request.ignore_eos,
                                 stop=text.stop_matched if stops else None, logprobs=logprobs is not None,
                                 top_logprobs=logprobs or 0)
                  for i, text in enumerate(texts)]
        try:
            for p in params:
                p.validate(self.engine.config.vocab_size, self.engine.max_top_logprobs)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return Job(kind, f"{prefix}-{secrets.token_hex(12)}", self.served.name, ids, params,
                   [Choice(i, text) for i, text in enumerate(texts)], logprobs, include_usage, list(images))

    # ---- running a job --------------------------------------------------------------------------
    async def run(self, job: Job) -> AsyncIterator[Piece]:
        """Submits the job's choices; yields their Pieces as tokens come, until every choice has ended."""
        events: asyncio.Queue = asyncio.Queue()
        try:
            for choice, params in zip(job.choices, job.params):
                choice.request_id = self.engine.submit(job.prompt, params, events=_ToLoop(events, choice),
                                                       images=job.images)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(job.prompt) * len(job.choices))
            open_choices = len(job.choices)
            first = True
            while open_choices:
                choice, event = await events.get()
                if isinstance(event, Finished):
                    open_choices -= 1
                    choice.finish_reason = "stop" if event.reason == "stop" or choice.text.stopped else event.reason
                    if self.metrics is not None:
                        self.metrics.finished.labels(choice.finish_reason).inc()
                    yield Piece(choice.index, choice.text.finish(), [], choice.finish_reason)
                    continue
                self._timed(job, first)
                first = False
                choice.tokens.append(event)
                yield Piece(choice.index, choice.text.add(event.token), [event], None)
        finally:
            for choice in job.choices:
                if choice.request_id is not None and choice.finish_reason is None:
                    self.engine.cancel(choice.request_id)
                    choice.finish_reason = "abort"
                    if self.metrics is not None:
                        self.metrics.finished.labels("abort").inc()

    def _timed(self, job: Job, first: bool) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        if first:
            self.metrics.ttft.observe(now - job.arrived)
        else:
            self.metrics.tpot.observe(now - job.last_token)
        job.last_token = now
        self.metrics.tokens_sent(1)

    # ---- bodies ---------------------------------------------------------------------------------
    def usage(self, job: Job) -> dict:
        completion = sum(len(c.tokens) for c in job.choices)
        return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
                "total_tokens": len(job.prompt) + completion}

    def response(self, job: Job) -> dict:
        """The whole (non-streaming) body once `run` has ended."""
        choices = []
        for c in job.choices:
            if job.kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text.sent},
                                "logprobs": self.chat_logprobs(job, c.tokens), "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text.sent, "logprobs": self.completion_logprobs(job, c.tokens),
                                "finish_reason": c.finish_reason})
        return {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": job.model, "choices": choices, "usage": self.usage(job)}

    def chunk(self, job: Job, piece: Piece, first: bool) -> dict | None:
        """One server-sent event's body for `piece` (None when it adds nothing)."""
        if not piece.text and not piece.tokens and piece.finish_reason is None and not first:
            return None
        if job.kind == "chat":
            delta = {"role": "assistant", "content": piece.text} if first else (
                {"content": piece.text} if piece.text or piece.tokens else {})
            choice = {"index": piece.index, "delta": delta, "logprobs": self.chat_logprobs(job, piece.tokens),
                      "finish_reason": piece.finish_reason}
        else:
            choice = {"index": piece.index, "text": piece.text, "logprobs": self.completion_logprobs(job, piece.tokens),
                      "finish_reason": piece.finish_reason}
        return self._chunk_body(job, [choice])

    def usage_chunk(self, job: Job) -> dict:
        return {**self._chunk_body(job, []), "usage": self.usage(job)}

    def _chunk_body(self, job: Job, choices: list) -> dict:
        return {"id": job.id, "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": job.model, "choices": choices}

    def _token_text(self, token: int) -> str:
        return self.served.tokenizer.decode([token], skip_special=False)

    def chat_logprobs(self, job: Job, tokens: list[TokenEvent]) -> dict | None:
        if job.logprobs is None or not tokens:
            return None

        def entry(token, logprob):
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs]}
                            for e in tokens]}

    def completion_logprobs(self, job: Job, tokens: list[TokenEvent]) -> dict | None:
        if job.logprobs is None or not tokens:
            return None
        return {"tokens": [self._token_text(e.token) for e in tokens],
                "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [{self._token_text(t): lp for t, lp in e.top_logprobs} for e in tokens]}


class _ToLoop:
    """The engine's `events` queue for one choice: each event the engine thread puts goes, with its
    choice, to an asyncio queue of the event loop running the job."""

    def __init__(self, events: asyncio.Queue, choice: Choice):
        self.events, self.choice, self.loop = events, choice, asyncio.get_running_loop()

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.choice, event))
