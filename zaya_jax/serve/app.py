"""The OpenAI-compatible HTTP API (FastAPI on uvicorn, as vLLM's and SGLang's servers).

  GET  /health                 200 while the engine runs
  GET  /metrics                Prometheus text (zaya_jax.serve.metrics)
  GET  /v1/models              the one model served
  POST /v1/completions         CompletionRequest, streamed ("stream": true) as server-sent events
  POST /v1/chat/completions    ChatCompletionRequest, likewise

With an api_key, every /v1 route answers 401 unless the request carries `Authorization: Bearer
KEY` (vLLM's --api-key). Every refusal is OpenAI's error object with its status (protocol.APIError):
malformed JSON, a body that is not sent as JSON or a bad field 400, an unknown model or route 404,
a body past max_request_bytes 413 (zaya_jax.serve.body_limit), a full queue 429. A request's
tokenization (its chat template, its images) and its non-streaming response run on a worker
thread, so the event loop answers other clients meanwhile. A streaming client that disconnects
ends its job at once (its engine requests cancelled, slots freed); a non-streaming one is watched
for a disconnect while it waits. READY_LINE is what the CLI prints once the server listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from zaya_jax.serve.body_limit import BodyLimit, default_max_request_bytes
from zaya_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_from_validation
from zaya_jax.serve.service import Job, Service

DISCONNECT_POLL_S = 0.1
READY_LINE = "serving http://{host}:{port}/v1 (model {name}, {slots} slots of {context} tokens)"


def create_app(service: Service, api_key: str | None = None, max_request_bytes: int | None = None) -> FastAPI:
    """The ASGI app over `service` (whose engine the caller starts and stops); a request body of more
    than max_request_bytes is a 413 (None: body_limit.default_max_request_bytes of the engine's)."""
    app = FastAPI(title="zaya_jax", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics

    def refused(err: APIError) -> JSONResponse:
        if metrics is not None:
            metrics.errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError):
        return refused(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        errors = err.errors()
        sent_as = request.headers.get("content-type")
        if sent_as and not _is_json(sent_as):
            return refused(APIError(400, f"the body is sent as Content-Type: {sent_as}; send JSON with the header "
                                    "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')"))
        if errors and errors[0].get("type") == "json_invalid":
            return refused(APIError(400, f"the body is not valid JSON ({errors[0].get('msg')})"))
        return refused(error_from_validation(errors))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        where = f"{request.method} {request.url.path}"
        if err.status_code == 404:
            routes = ", ".join(sorted({route.path for route in app.routes}))
            return refused(APIError(404, f"no route {where}; this server answers {routes}", None, "not_found"))
        if err.status_code == 405:
            return refused(APIError(405, f"{where}: method not allowed; use {(err.headers or {}).get('Allow')}"))
        return refused(APIError(err.status_code, str(err.detail)))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return refused(APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                        None, "invalid_api_key", kind="authentication_error"))
        return await call_next(request)

    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(service.engine.cache_size, service.engine.image_processor)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes,
                       refused=lambda status, message: refused(APIError(status, message)))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        served = service.served
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "zaya_jax", "max_model_len": service.engine.cache_size}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(await run_in_threadpool(service.completion_job, body), body.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(await run_in_threadpool(service.chat_job, body), body.stream, request)

    async def answer(job: Job, stream: bool, request: Request):
        if stream:
            return StreamingResponse(events(job), media_type="text/event-stream")
        pieces = service.run(job)
        consume = asyncio.ensure_future(_drain(pieces))
        while not consume.done():
            await asyncio.wait([consume], timeout=DISCONNECT_POLL_S)
            if not consume.done() and await request.is_disconnected():
                consume.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consume
                await pieces.aclose()  # cancels the job's engine requests
                return Response(status_code=499)
        consume.result()
        return await run_in_threadpool(service.response, job)

    async def events(job: Job):
        pieces = service.run(job)
        first = {c.index for c in job.choices}
        try:
            async for piece in pieces:
                body = service.chunk(job, piece, piece.index in first)
                first.discard(piece.index)
                if body is not None:
                    yield f"data: {json.dumps(body)}\n\n"
            if job.include_usage:
                yield f"data: {json.dumps(service.usage_chunk(job))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await pieces.aclose()

    return app


def _is_json(content_type: str) -> bool:
    """As FastAPI reads a body: application/json or application/*+json."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _drain(pieces) -> None:
    async for _ in pieces:
        pass
