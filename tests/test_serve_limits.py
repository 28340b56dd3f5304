"""What one client cannot do to the others: the app (zaya_jax.serve.app) in this process on port 0,
over an engine that is never started (every request here ends before a slot), driven over HTTP.

A prompt whose tokenization is held (the tokenizer's encode waits on an event) does not stop
/health or another client from being answered meanwhile; a body past max_request_bytes is a 413
(from its Content-Length, or read chunked); a prompt text longer than the context can hold in
the tokenizer's longest tokens is refused without tokenizing; an unknown route, a wrong method
and a form-encoded body get OpenAI error objects.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from tests.harness_fixtures import TEXTS, TINY_LM

pytestmark = pytest.mark.xdist_group("serve_limits")

openai = pytest.importorskip("openai")

NAME, LIMIT, CONTEXT = "tiny", 4096, 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from zaya_jax.data.tokenizer import Tokenizer, train_bpe
    path = train_bpe(TEXTS, tmp_path_factory.mktemp("limits") / "tokenizer.json", vocab_size=300)
    return Tokenizer(path, bos_id=2, eos_id=1, pad_id=0)


@pytest.fixture(scope="module")
def base(tokenizer):
    """The app's base URL (…/v1) on a uvicorn thread: a tiny model's engine (not started), a body limit of
    4096 bytes, a context of 64 tokens."""
    import uvicorn

    from zaya_jax.engine.engine import Engine
    from zaya_jax.model.build import create_model
    from zaya_jax.serve.app import create_app
    from zaya_jax.serve.service import ServedModel, Service
    engine = Engine(create_model(TINY_LM, seed=0), slots=2, cache_size=CONTEXT, chunk=8)
    service = Service(engine, ServedModel(NAME, tokenizer, None, []), max_waiting=4)
    server = uvicorn.Server(uvicorn.Config(create_app(service, max_request_bytes=LIMIT), log_level="warning",
                                           lifespan="off"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server.should_exit = True
    thread.join(10)


def test_health_and_other_clients_answer_while_a_prompt_is_tokenized(base, tokenizer, monkeypatch):
    """The big request is still in its tokenizer (held there) when /health and another client's
    request are answered; released, it ends in the over-long 400."""
    started, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held(text):
        started.set()
        release.wait(30)
        return encode(text)
    monkeypatch.setattr(tokenizer, "encode", held)
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    prompt = " ".join("7" * 150)  # 299 characters, fewer than 64 tokens of at most 6 characters hold
    assert len(prompt) <= CONTEXT * tokenizer.max_token_chars() and len(encode(prompt)) > CONTEXT
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(client.completions.create, model=NAME, prompt=prompt, max_tokens=1)
        try:
            assert started.wait(30)
            assert httpx.get(base.removesuffix("/v1") + "/health", timeout=10).status_code == 200
            assert client.with_options(timeout=10).models.list().data[0].id == NAME
            with pytest.raises(openai.NotFoundError):
                client.with_options(timeout=10).completions.create(model="other", prompt="x")
            assert not big.done()
        finally:
            release.set()
        with pytest.raises(openai.BadRequestError, match="more than this server's context of 64 tokens"):
            big.result()


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(base, tokenizer, monkeypatch):
    """Past 64 x the vocabulary's longest entry in characters (read here from tokenizer.json) a
    prompt is refused by its length alone, for completions and for chat; at that length it is
    tokenized."""
    vocab = json.load(open(tokenizer.path))["model"]["vocab"]
    bound = CONTEXT * max(len(token) for token in vocab)
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(len(text)) or [5] * 100)  # bos + 100: 101
    auth = {"Content-Type": "application/json"}
    over = httpx.post(f"{base}/completions", json={"model": NAME, "prompt": "a" * (bound + 1)}, headers=auth)
    assert over.status_code == 400 and calls == []
    error = over.json()["error"]
    assert f"the prompt is {bound + 1} characters" in error["message"] and error["code"] == "context_length_exceeded"
    at = httpx.post(f"{base}/completions", json={"model": NAME, "prompt": "a" * bound})
    assert at.status_code == 400 and "101 tokens, 37 more than" in at.json()["error"]["message"]
    assert calls == [bound]


def test_a_body_past_the_limit_is_a_413_with_or_without_content_length(base):
    body = json.dumps({"model": NAME, "prompt": "x" * LIMIT}).encode()
    sized = httpx.post(f"{base}/completions", content=body, headers={"Content-Type": "application/json"})
    assert sized.status_code == 413, sized.text
    error = sized.json()["error"]
    assert f"{len(body)} bytes, more than this server's limit of {LIMIT} bytes" in error["message"]
    assert error["type"] == "invalid_request_error" and "--max_request_bytes" in error["message"]
    chunked = httpx.post(f"{base}/completions", content=iter([body[i:i + 1000] for i in range(0, len(body), 1000)]),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    assert f"limit of {LIMIT} bytes" in chunked.json()["error"]["message"]
    # refused from its Content-Length before a byte of it is read: the headers alone are answered
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as announced:
        announced.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {10 * 2 ** 20}\r\n\r\n".encode())
        head = announced.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413") and f"{10 * 2 ** 20} bytes, more than" in head, head[:300]
    under = httpx.post(f"{base}/completions", json={"model": "other", "prompt": "x" * (LIMIT - 100)})
    assert under.status_code == 404  # read and answered: the model's name is wrong
    assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200


def test_unknown_routes_methods_and_form_bodies_get_openai_errors(base):
    for answer, status, words_ in [
            (httpx.get(f"{base}/nothing"), 404, "no route GET /v1/nothing; this server answers"),
            (httpx.get(f"{base}/completions"), 405, "GET /v1/completions: method not allowed; use POST"),
            (httpx.post(f"{base}/completions", data={"model": NAME, "prompt": "x"}), 400,
             "application/x-www-form-urlencoded; send JSON with the header 'Content-Type: application/json'")]:
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert words_ in error["message"] and set(error) == {"message", "type", "param", "code"}, error
    assert "/v1/chat/completions" in httpx.get(f"{base}/nothing").json()["error"]["message"]
