"""localspec.server.guard and the request checks beside it, in process and without a model (the live-server
versions are in test_serve_guard.py)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from localspec.server.errors import ApiError
from localspec.server.guard import Guard, GuardSettings, PromptLimits
from localspec.server.schema import parse_body


class State:
    def __init__(self, api_key: str | None = None, **guard: object) -> None:
        self.api_key = api_key
        self.guard = GuardSettings(**guard)  # type: ignore[arg-type]

    def body_limit(self) -> int:
        return 100


def client(state: State, host: str = "localhost") -> TestClient:
    app = FastAPI()
    app.add_middleware(Guard, state=state)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"ok": True}

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    return TestClient(app, base_url=f"http://{host}")


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost", True), ("localhost:8080", True), ("127.0.0.1:1", True), ("[::1]:8080", True), ("[::1]", True),
    ("LocalHost.", True), ("10.1.2.3:80", True),  # the bound address
    ("attacker.example", False), ("localhost.attacker.example", False), ("127.0.0.1.nip.io", False),
    ("[::2]:80", False), ("lan-box:9", False),
])
def test_host_header_without_a_key(host: str, allowed: bool) -> None:
    r = client(State(bound_host="10.1.2.3"), host).get("/v1/models")
    assert r.status_code == (200 if allowed else 403), r.text
    if not allowed:
        assert r.json()["error"]["param"] == "Host" and "--allowed-hosts" in r.json()["error"]["message"]


def test_allowed_hosts_and_a_key_widen_it() -> None:
    assert client(State(allowed_hosts=("lan-box",)), "lan-box:9").get("/v1/models").status_code == 200
    assert client(State(allowed_hosts=("*",)), "anything").get("/v1/models").status_code == 200
    keyed = client(State(api_key="k"), "anything")
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert keyed.get("/v1/models").status_code == 401  # any Host, but the key


def test_the_key_is_checked_before_the_type_and_size_of_the_body() -> None:
    c = client(State(api_key="k"))
    for headers in ({}, {"Content-Type": "text/plain"}):
        r = c.post("/echo", content=b"x" * 500, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    assert c.post("/echo", content=b"x" * 500, headers={"X-Api-Key": "k", "Content-Type": "application/json"}
                  ).status_code == 413
    assert c.options("/echo").status_code != 401  # a CORS preflight carries no credentials


@pytest.mark.parametrize(("content_type", "status"), [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/merge-patch+json", 200), ("text/plain", 415), ("text/plain; a=application/json", 415),
    ("multipart/form-data; boundary=x", 415), ("application/x-www-form-urlencoded", 415), (None, 415),
])
def test_posts_must_be_json(content_type: str | None, status: int) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    r = client(State()).post("/echo", content=b'{"a": 1}', headers=headers)
    assert r.status_code == status, r.text


def test_a_body_past_the_limit_is_413_declared_or_not() -> None:
    c = client(State())
    assert c.post("/echo", json={"a": "x" * 50}).status_code == 200
    r = c.post("/echo", json={"a": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = c.post("/echo", content=iter([b'{"a": "', b"x" * 200, b'"}']),
                     headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413


def test_prompt_limits() -> None:
    limits = PromptLimits(n_ctx=512, max_piece_bytes=20)
    assert limits.text_chars == 10240 and limits.body_bytes == 1 << 20  # the floor
    limits.check_text("x" * 10240, "prompt")
    with pytest.raises(ApiError, match="prompt: 10241 characters are more than 512 tokens") as info:
        limits.check_text("x" * 10241, "prompt")
    # llama.cpp's type and numbers: at least 513 tokens (10241 bytes, at most 20 a token)
    assert (info.value.kind, info.value.extra) == ("exceed_context_size_error", {"n_prompt_tokens": 513, "n_ctx": 512})
    with pytest.raises(ApiError, match="messages: 512 messages cannot fit") as info:
        limits.check_messages(["a"] * 512)
    assert info.value.code == "context_length_exceeded" and info.value.extra == {"n_prompt_tokens": 512, "n_ctx": 512}
    big = PromptLimits(n_ctx=1 << 17, max_piece_bytes=64)
    assert big.body_bytes > 6 * big.text_chars
    assert PromptLimits(512, None).text_chars is None  # a normalizing tokenizer: no byte bound


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    (b'{"prompt": "\\udc80"}', "prompt"),
    (b'{"stop": ["ok", "\\udbff"]}', "stop[1]"),
    (b'{"a\\ud800b": 1}', "a\\ud800b"),
    (b'"\\ud800"', None),
])
def test_a_lone_surrogate_is_refused_naming_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(ApiError, match="lone surrogate") as caught:
        parse_body(body)
    assert caught.value.param == param
    caught.value.message.encode("utf-8")  # the error itself is text
    assert parse_body('{"ok": "\\ud83d\\ude00 \u00e9"}'.encode()) == {"ok": "\U0001f600 \u00e9"}  # a proper pair
