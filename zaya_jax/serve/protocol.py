"""The OpenAI request bodies the server accepts, checked, and the error object it answers with.

  CompletionRequest       POST /v1/completions        prompt: a string or one list of token ids
  ChatCompletionRequest   POST /v1/chat/completions   messages: [{role, content}], content a string
                                                      or a list of {"type": "text"} parts and, for a
                                                      vision-language model, {"type": "image_url"} ones

Fields and defaults are OpenAI's (temperature 1, top_p 1, max_tokens 16 for completions and the
rest of the context for chat), with vLLM's extensions `top_k` (-1: off) and `ignore_eos`. A value
OpenAI allows but this server cannot honour (echo, best_of, suffix, penalties, logit_bias, several
prompts in one request) is refused by name rather than ignored, and so is every field not declared
here (`tools`, `tool_choice`, `response_format` among them): nothing sent is dropped silently but
`user`, `metadata`, `store` and `service_tier`, which describe a request and change nothing in its
answer. Every refusal is an `APIError`: the HTTP status and OpenAI's error object,
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4
NOT_YET = {  # OpenAI fields whose feature this server does not have, and what a client does instead
    "tools": "tool calls are not implemented: describe the tools in a message and parse the text",
    "tool_choice": "tool calls are not implemented",
    "parallel_tool_calls": "tool calls are not implemented",
    "functions": "function calls are not implemented",
    "function_call": "function calls are not implemented",
    "response_format": "structured output is not implemented: the answer is free text",
}


class APIError(Exception):
    """A request the server refuses: `status` (400, 401, 404, 429, 503) and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share: the model, sampling, stopping and streaming."""
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings, got {stops!r}", "stop")
        return stops

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name}: not supported by this server (send 0 or leave it out)", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server", "logit_bias")
        if self.top_k == 0:
            raise APIError(400, "top_k: 0 keeps no token; use -1 (off) or a positive count", "top_k")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name, unsupported in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                                  ("suffix", bool(self.suffix))):
            if unsupported:
                raise APIError(400, f"{name}: not supported by this server", name)

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a list of one of either is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: {len(prompt)} prompts in one request; send one per request "
                               "(they are batched together anyway)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt: empty", "prompt")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart | ImagePart]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")


def error_from_validation(errors: list[dict]) -> APIError:
    """pydantic's first complaint as one 400: the field's dotted path and what is wrong with it."""
    def path(error: dict) -> list[str]:
        return [str(p) for p in error.get("loc", ()) if p != "body"]
    unknown = [path(e) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        reasons = dict.fromkeys(NOT_YET.get(where[-1], "not implemented") for where in unknown)
        names = ", ".join(".".join(where) for where in unknown)
        return APIError(400, f"{names}: not supported by this server ({'; '.join(reasons)}); leave "
                        f"{'it' if len(unknown) == 1 else 'them'} out", ".".join(unknown[0]))
    where = path(errors[0])
    param = ".".join(where) or None
    return APIError(400, f"{param or 'body'}: {errors[0].get('msg', 'invalid')}", param)
