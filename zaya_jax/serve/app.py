"""The OpenAI-compatible HTTP API (FastAPI on uvicorn, as vLLM's and SGLang's servers).

  GET  /health                 200 while the engine runs
  GET  /metrics                Prometheus text (zaya_jax.serve.metrics)
  GET  /v1/models              the one model served
  POST /v1/completions         CompletionRequest, streamed ("stream": true) as server-sent events
  POST /v1/chat/completions    ChatCompletionRequest, likewise

With an api_key, every /v1 route answers 401 unless the request carries `Authorization: Bearer
KEY` (vLLM's --api-key). Every refusal is OpenAI's error object with its status (protocol.APIError):
malformed JSON or a bad field 400, an unknown model 404, a full queue 429. A streaming client that
disconnects ends its job at once (its engine requests cancelled, slots freed); a non-streaming one
is watched for a disconnect while it waits.
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

from zaya_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_from_validation
from zaya_jax.serve.service import Job, Service

DISCONNECT_POLL_S = 0.1


def create_app(service: Service, api_key: str | None = None) -> FastAPI:
    """The ASGI app over `service` (whose engine the caller starts and stops)."""
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
    async def invalid(_request: Request, err: RequestValidationError):
        errors = err.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return refused(APIError(400, f"the body is not valid JSON ({errors[0].get('msg')})"))
        return refused(error_from_validation(errors))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return refused(APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                        None, "invalid_api_key", kind="authentication_error"))
        return await call_next(request)

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
        return await answer(service.completion_job(body), body.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(service.chat_job(body), body.stream, request)

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
        return service.response(job)

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


async def _drain(pieces) -> None:
    async for _ in pieces:
        pass
