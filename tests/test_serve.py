"""`localspec serve` end to end: a live uvicorn server on a free loopback port with the offline demo pair, driven
by the official `openai` client (and httpx where headers matter).

Every wait is bounded in time; every loop in count.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from localspec.config import load_preset
from localspec.sessions.session import open_session
from tests.helpers_serve import PROMPT, demo_files, find_stop_in_draft_run

pytestmark = pytest.mark.slow

KEY = "sekrit-test-key"
N = 16


class Server:
    def __init__(self, home: Path, tmp: Path, *args: str) -> None:
        self.log = tmp / "serve.log"
        env = {**os.environ, "LOCALSPEC_HOME": str(home), "COLUMNS": "200"}
        env.pop("LOCALSPEC_DEBUG", None)
        env.pop("LOCALSPEC_API_KEY", None)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from localspec.cli.app import main; main()", "serve", "--port", "0", *args],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_for_url()
        self.root = self.url.removesuffix("/v1")
        self._wait_ready()

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"http://127\.0\.0\.1:\d+/v1", self.log.read_text())
            if found:
                return found.group(0)
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.2)
        raise AssertionError(f"no URL printed: {self.log.read_text()}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            r = httpx.get(f"{self.root}/health", timeout=10)
            if r.status_code == 200:
                return
            assert r.status_code == 503 and r.json()["status"] == "loading"
            time.sleep(0.2)
        raise AssertionError(f"not ready: {self.log.read_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.root}/health", timeout=10).json()

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=600, **kw)

    def wait_idle(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if not h["busy"] and not h["queued"]:
                return h
            time.sleep(0.1)
        raise AssertionError(f"still busy: {self.health()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(demo_home, tmp_path_factory) -> Iterator[Server]:
    # The base demo, named (serve's default is the instruct demo): its greedy output is checked against plain
    # decoding below, and its slots take turns (tests of the batched ones use demo-chat).
    s = Server(demo_home, tmp_path_factory.mktemp("serve"), "--always-draft",
               "--pair", "demo", "--cors-origin", "http://ui.example",
               "--threads", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(demo_home, tmp_path_factory) -> Iterator[Server]:
    """An API key and room for one waiting request."""
    s = Server(demo_home, tmp_path_factory.mktemp("serve-key"), "--always-draft",
               "--pair", "demo", "--api-key", KEY, "--queue", "1",
               "--threads", "1")
    yield s
    s.stop()


def run_cli(home: Path, *args: str) -> str:
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    env.pop("LOCALSPEC_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def stream_text(chunks) -> str:
    out = []
    for chunk in chunks:
        if chunk.choices:
            choice = chunk.choices[0]
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            out.append(piece or "")
    return "".join(out)


# -- answers -------------------------------------------------------------------------------------------------


def test_models_health_and_cors(server):
    assert [m.id for m in server.client().models.list()] == ["demo"]
    assert server.health()["status"] == "ok"
    preflight = httpx.options(f"{server.url}/chat/completions", timeout=10, headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    missing = httpx.get(f"{server.url}/nothing", timeout=10)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_greedy_completion_equals_generate(server, demo_home):
    want = run_cli(demo_home, "generate", PROMPT, "--temp", "0", "--max-tokens", str(N))
    client = server.client()
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0)
    assert whole.choices[0].text == want
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == N
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == N and 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["acceptance_rate"] == pytest.approx(timings["draft_n_accepted"] / timings["draft_n"], abs=1e-3)
    streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
    assert stream_text(streamed) == want
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                                      extra_body={"speculative": {"n_max": 0}})
    assert plain.choices[0].text == want
    assert plain.model_extra["timings"]["draft_n"] == 0


def test_greedy_chat_equals_generate_and_streams_draft_stats(server, demo_home):
    want = run_cli(demo_home, "generate", PROMPT, "--chat", "--temp", "0", "--max-tokens", str(N), "--pair", "demo")
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_text(chunks) == want
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_inside_an_accepted_draft_run_leaks_nothing(server, demo_home):
    greedy = load_preset("greedy").with_overrides(stand_aside=False)  # (the server drafts every round too)
    with open_session(demo_files(demo_home), greedy.with_overrides(n_ctx=256)) as local:
        case = find_stop_in_draft_run(local.engine, local.target.tokenize(PROMPT), greedy.sampling, greedy.draft, 40)
    client = server.client()
    kw = dict(model="demo", prompt=PROMPT, max_tokens=40, temperature=0, stop=[case.stop])
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == case.text[: case.cut] and whole.choices[0].finish_reason == "stop"
    timings = whole.model_extra["timings"]
    assert whole.usage.completion_tokens == timings["predicted_n"] == case.returned_tokens
    assert timings["draft_n_accepted"] == case.returned_from_draft <= timings["predicted_n"]
    chunks = list(client.completions.create(**kw, stream=True))
    assert stream_text(chunks) == case.text[: case.cut]  # every chunk, the final one included
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_n_shrinks_on_the_second_turn(server):
    client = server.client()
    turn1 = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="demo", messages=turn1, max_tokens=8, temperature=0)
    reply = first.choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model="demo", messages=turn2, max_tokens=8, temperature=0)
    p1, p2 = first.usage.prompt_tokens, second.usage.prompt_tokens
    n1, n2 = first.model_extra["timings"]["prompt_n"], second.model_extra["timings"]["prompt_n"]
    assert n1 > p1 // 2  # turn 1 was mostly new
    assert n2 <= p2 - p1  # turn 2 processed only what follows turn 1's prompt (not even all of the reply)
    assert second.usage.prompt_tokens_details.cached_tokens == p2 - n2 >= p1


def test_two_concurrent_clients_both_complete(server):
    client = server.client()
    prompts = [PROMPT, "Once upon a time"]
    want = [client.completions.create(model="demo", prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = stream_text(client.completions.create(model="demo", prompt=prompts[i], max_tokens=8,
                                                       temperature=0, stream=True))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert got == {0: want[0], 1: want[1]}


def test_a_client_that_disconnects_frees_the_engine(server):
    before = server.wait_idle()["cancelled"]
    client = server.client()
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()  # the connection goes away mid-generation
    t0 = time.monotonic()
    quick = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0)
    assert quick.usage.completion_tokens == 2
    assert time.monotonic() - t0 < 120  # not behind 3000 tokens of a departed client
    after = server.wait_idle()
    assert after["cancelled"] == before + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_a_json_client_that_gives_up_is_cancelled_within_2_s(server, path):
    """Before: `curl -m 3` on a 3000-token request left it running to the end (a core busy, /health running 1)."""
    before = server.wait_idle()["cancelled"]
    with pytest.raises(httpx.ReadTimeout):  # as curl -m 3: the client closes its socket
        httpx.post(f"{server.root}{path}", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "temperature": 0},
                   timeout=3)
    t0 = time.monotonic()
    deadline = t0 + 60
    while server.health()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert server.health()["cancelled"] == before + 1 and took < 2.0, f"cancelled after {took:.1f} s"
    assert not server.wait_idle()["busy"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 65}, "n"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                "function": {"name": "g"}}},
     "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"extra_body": {"grammar": "root ::= nope"}}, "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/s"}}}]},
     "tools"),
])
def test_unsupported_fields_are_a_400_naming_them(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, **extra)
    error = info.value.body
    assert error["param"] == param and param in error["message"]


def test_a_prompt_larger_than_the_context_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model="demo", prompt="word " * 5000, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"


# -- the guarded server: key and queue -----------------------------------------------------------------------


def test_api_key_is_required_except_for_health(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    assert httpx.post(f"{guarded.url}/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    assert [m.id for m in guarded.client(KEY).models.list()] == ["demo"]  # Bearer
    by_header = httpx.get(f"{guarded.url}/models", headers={"X-Api-Key": KEY}, timeout=10)
    assert by_header.status_code == 200
    assert httpx.get(f"{guarded.root}/health", timeout=10).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(guarded):
    client = guarded.client(KEY)
    running = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
    next(iter(running))  # it is generating
    waiting: dict[str, object] = {}
    thread = threading.Thread(target=lambda: waiting.update(r=client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=2, temperature=0)))
    thread.start()
    deadline = time.monotonic() + 60
    while guarded.health()["queued"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guarded.health()["queued"] == 1
    full = httpx.post(f"{guarded.url}/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"
    running.close()  # frees the engine for the waiting request
    thread.join(timeout=300)
    assert waiting["r"].usage.completion_tokens == 2
    assert guarded.health()["rejected"] == 1


def test_ctrl_c_cancels_in_flight_work_and_exits_0(guarded):
    client = guarded.client(KEY)
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
    next(iter(stream))
    t0 = time.monotonic()
    guarded.proc.send_signal(signal.SIGINT)
    received = 0
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:  # ends with the server's shutdown error, or a connection closed mid-stream
            received += 1
    assert received < 3000
    assert guarded.proc.wait(timeout=120) == 0
    assert time.monotonic() - t0 < 120
    assert "stopped" in guarded.log.read_text()


@pytest.fixture(scope="module")
def slots4(demo_home, tmp_path_factory) -> Iterator[Server]:
    # SmolLM2 (Llama-style): llama.cpp batches its sequences exactly (Gemma 3's are checked in test_slots.py).
    s = Server(demo_home, tmp_path_factory.mktemp("serve-slots"), "--always-draft",
               "--parallel", "4", "--pair", "demo-chat",
               "--threads", "1")
    yield s
    s.stop()


def test_four_concurrent_clients_get_what_each_gets_alone(slots4):
    """`serve --parallel 4`: four `openai` clients at once (staggered, different prompts, lengths and draft
    lengths) are batched into shared rounds, and each reply is token for token the reply it gets alone."""
    requests = [
        dict(prompt="The three primary colours are", max_tokens=40, extra_body={"speculative": {"n_max": 6}}),
        dict(prompt="Once upon a time, in a small village", max_tokens=32, extra_body={"speculative": {"n_max": 3}}),
        dict(prompt="def fibonacci(n):", max_tokens=48, extra_body={"speculative": {"n_max": 0}}),
        dict(prompt="The capital of France is", max_tokens=24, extra_body={}),
    ]
    client = slots4.client()
    model = client.models.list().data[0].id

    def ask(r: dict) -> tuple[str, int]:
        out = client.completions.create(model=model, temperature=0, **r)
        return out.choices[0].text, out.usage.completion_tokens

    alone = [ask(r) for r in requests]
    health = slots4.wait_idle()
    assert health["slots"] == 4 and health["slots_batched"]
    assert health["slots_batch_error"] == 0.0 and health["width_noise"] == 0.0  # the CPU: bit for bit
    assert {name: {k: v for k, v in b.items() if k != "sequences_per_call"}
            for name, b in health["slot_batches"].items()} == {name: {"shared": True, "error": 0.0, "width_noise": 0.0}
                                                                for name in ("target", "draft")}
    together: list[tuple[str, int] | None] = [None] * 4
    peak = {"running": 0}

    def worker(i: int) -> None:
        time.sleep(0.1 * i)  # staggered arrivals: later requests join rounds already under way
        together[i] = ask(requests[i])

    def watch() -> None:
        while any(t is None for t in together):
            peak["running"] = max(peak["running"], slots4.health()["running"])
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert together == alone
    assert peak["running"] >= 2  # they really ran at the same time
    assert slots4.wait_idle()["failed"] == 0


def test_slots_that_take_turns_draft_beside_the_verifies_and_clients_get_what_each_gets_alone(demo_home,
                                                                                              tmp_path_factory):
    """The base demo's (`--pair demo`) Gemma 3 target shares no batch exactly (its slots take turns, `/health`),
    and with `--draft-ahead on` the draft model drafts the other slots' proposals beside each verify, as on a GPU:
    three staggered `openai` clients at T = 0 each get, token for token, what they get alone."""
    server = Server(demo_home, tmp_path_factory.mktemp("serve-turns"), "--always-draft",
                    "--pair", "demo", "--parallel", "3",
                    "--threads", "1", "--draft-ahead", "on")
    try:
        client = server.client()
        model = client.models.list().data[0].id
        requests = [
            dict(prompt="The three primary colours are", max_tokens=30, extra_body={"speculative": {"n_max": 6}}),
            dict(prompt="Once upon a time", max_tokens=24, extra_body={"speculative": {"n_max": 3}}),
            dict(prompt="def add(a, b):", max_tokens=28, extra_body={}),
        ]

        def ask(r: dict) -> str:
            return client.completions.create(model=model, temperature=0, **r).choices[0].text

        alone = [ask(r) for r in requests]
        health = server.wait_idle()
        assert health["slots"] == 3 and not health["slots_batched"]
        assert not health["slot_batches"]["target"]["shared"] and health["slot_batches"]["target"]["error"] > 0.5
        together: list[str | None] = [None] * 3

        def worker(i: int) -> None:
            time.sleep(0.1 * i)
            together[i] = ask(requests[i])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert together == alone
        assert server.wait_idle()["failed"] == 0
    finally:
        server.stop()


def test_a_departing_client_frees_its_slot_for_the_next(slots4):
    """Four long streams fill the slots; one client leaves; a fifth request gets its slot while three go on."""
    before = slots4.wait_idle()
    client = slots4.client()
    model = client.models.list().data[0].id
    # Greedy, so none of them can end early by chance (an end-of-turn token would free a slot too soon).
    streams = [client.completions.create(model=model, prompt=f"Story {i}:", max_tokens=3000, temperature=0,
                                         stream=True) for i in range(4)]
    for s in streams:
        next(iter(s))  # each has started: all four slots are busy
    assert slots4.health()["running"] == 4
    streams[0].close()
    quick = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert quick.usage.completion_tokens == 2
    assert slots4.health()["running"] == 3  # the others are still generating
    for s in streams[1:]:
        s.close()
    after = slots4.wait_idle()
    assert after["cancelled"] == before["cancelled"] + 4 and after["running"] == 0
    # What the engine measured of whole rounds with several requests in them, per batch size.
    assert after["rounds_tok_s"] == {}  # (--always-draft: no request may be cut, so the load policy measures nothing)


# -- structured output and logprobs (demo-chat: an instruct model) --------------------------------------------


@pytest.fixture(scope="module")
def chat_server(demo_home, tmp_path_factory) -> Iterator[Server]:
    """The instruct demo, one llama.cpp thread (a busy test box stalls a spinning pool)."""
    s = Server(demo_home, tmp_path_factory.mktemp("serve-chat"), "--always-draft",
               "--pair", "demo-chat", "--threads", "1")
    yield s
    s.stop()

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_replies_parse_and_follow_the_schema(chat_server):
    client = chat_server.client()
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Describe a fictional person as JSON."}],
               max_tokens=120, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}})
    whole = client.chat.completions.create(**ask)
    person = json.loads(whole.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 12
    assert whole.choices[0].finish_reason == "stop"
    streamed = stream_text(client.chat.completions.create(**ask, stream=True))
    assert streamed == whole.choices[0].message.content
    anything = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    digits = client.completions.create(model=model, prompt="Count: one two three", max_tokens=8, temperature=0.7,
                                       extra_body={"grammar": 'root ::= [0-9]+'})
    assert digits.choices[0].text.isdigit()


def test_logprobs_come_with_every_token_streamed_or_not(chat_server):
    client = chat_server.client()
    model = client.models.list().data[0].id
    # (smollm2-chat's preset has a repeat penalty: logprobs describe the penalised row the token was chosen from.)
    ask = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24,
               temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    for c in content:  # greedy: the chosen token is the most likely one
        assert c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
    streamed = [t for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


def _reference_greedy(prompt: str, n: int, preset) -> list[tuple[str, np.ndarray]]:
    """Plain greedy decoding in a second context of the served model, one token a decode with full logits,
    penalised here (not by the engine's code) as the preset says: each token's text and its row's
    log-probabilities."""
    from localspec.llama.model import LlamaModel
    from localspec.models.demo import smollm2_source_path

    s = preset.sampling
    out = []
    with LlamaModel(smollm2_source_path(), n_ctx=512, device_top_k=0, n_gpu_layers=0, n_threads=1) as model:
        tokens = model.tokenize(prompt, add_special=True, parse_special=True)
        model.decode(tokens[:-1], 0)
        for _ in range(n):
            row = model.decode(tokens[-1:], len(tokens) - 1).logits[-1].astype(np.float64)
            window = tokens[-s.repeat_last_n :]
            for token in set(window):
                v = row[token]
                row[token] = (v / s.repeat_penalty if v > 0 else v * s.repeat_penalty) - \
                    window.count(token) * s.frequency_penalty - s.presence_penalty
            row -= row.max() + np.log(np.exp(row - row.max()).sum())
            chosen = int(np.argmax(row))
            if model.is_eog(chosen):
                break
            out.append((model.piece(chosen).decode("utf-8", errors="replace"), row))
            tokens.append(chosen)
    return out


@pytest.mark.parametrize("n_max", [0, 6], ids=["plain", "speculative"])
def test_a_greedy_tokens_logprob_is_the_top_of_its_alternatives_as_a_second_context_says(chat_server, n_max):
    """Before: with demo-chat's repeat penalty a chosen token ranked below its own alternatives ("Say a colour.":
    -2.815 chosen, -2.527 top): logprobs came from the raw row, the choice from the penalised one. The reference
    is plain greedy decoding in a context of its own, penalised by this test."""
    from localspec.config import load_preset

    body = {"prompt": "Say a colour.", "max_tokens": 16, "temperature": 0, "logprobs": 3,
            "speculative.n_max": n_max}
    reply = httpx.post(f"{chat_server.url}/completions", json=body, timeout=600).json()
    lp = reply["choices"][0]["logprobs"]
    ref = _reference_greedy(body["prompt"], 16, load_preset("smollm2-chat"))
    assert [text for text, _ in ref] == lp["tokens"]
    assert reply["timings"]["draft_n"] > 0 or n_max == 0
    for (text, row), chosen, top in zip(ref, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert chosen == max(top.values()) and list(top)[0] == text, (text, chosen, top)
        assert chosen == pytest.approx(row.max(), abs=1e-3)
        assert list(top.values()) == pytest.approx(np.sort(row)[::-1][:3].tolist(), abs=1e-3)


def test_with_a_grammar_a_greedy_token_is_still_the_first_of_its_alternatives(chat_server):
    """The row a constrained token was chosen from is the grammar-masked one: its alternatives are tokens the
    grammar allowed there (greedy: the best legal token is the first)."""
    client = chat_server.client()
    reply = client.chat.completions.create(
        model="demo-chat", messages=[{"role": "user", "content": "Describe a fictional person as JSON."}],
        max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, response_format={"type": "json_object"})
    content = reply.choices[0].logprobs.content
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    assert content[0].token.lstrip().startswith("{")  # the first token the grammar allows
    for c in content:
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert all(np.isfinite(a.logprob) for a in c.top_logprobs)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


def _streamed_calls(stream: Iterator) -> tuple[dict[int, dict], str | None]:
    """The calls a client rebuilds from OpenAI's incremental `delta.tool_calls`, checking the shape on the way:
    a call's first delta alone carries its id, type and name; later ones carry arguments text only."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or "", "pieces": 1}
            else:
                assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
                calls[d.index]["arguments"] += d.function.arguments
                calls[d.index]["pieces"] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))  # parallel calls: index 0, 1, ...
    return {i: {"name": c["name"], "arguments": c["arguments"]} for i, c in calls.items()}, finish


TRIP = [{"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip.",
    "parameters": {"type": "object", "properties": {
        "from_city": {"type": "string", "maxLength": 20}, "to_city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer"}, "by": {"enum": ["train", "plane", "car"]}},
        "required": ["from_city", "to_city", "days", "by"], "additionalProperties": False}}}]


def test_tool_call_arguments_stream_as_they_are_written(chat_server):
    """OpenAI's incremental shape, read by the official client and its stream helper: the arguments of a call
    come in many pieces as the model writes them, and they add up to the arguments of the same request not
    streamed (greedy)."""
    client = chat_server.client()
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Plan a 3 day trip from Lyon to Rome by train."}],
               tools=TRIP, tool_choice={"type": "function", "function": {"name": "plan_trip"}}, max_tokens=120,
               temperature=0)
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    expected = {i: {"name": c.function.name, "arguments": c.function.arguments}
                for i, c in enumerate(whole.choices[0].message.tool_calls)}
    for c in expected.values():
        assert c["name"] == "plan_trip" and set(json.loads(c["arguments"])) == {"from_city", "to_city", "days", "by"}
    pieces: dict[int, list[str]] = {}
    with client.beta.chat.completions.stream(**ask) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.setdefault(event.index, []).append(event.arguments_delta)
        final = stream.get_final_completion()
    assert {i: "".join(p) for i, p in pieces.items()} == {i: c["arguments"] for i, c in expected.items()}
    assert all(len(p) > 5 for p in pieces.values())
    assert final.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == \
        [c["arguments"] for c in expected.values()]
    calls, finish = _streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and calls == expected
    # Parallel calls stream side by side as index 0, 1.
    ask = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris and in Oslo?"}], tools=WEATHER,
               tool_choice="required", max_tokens=120, temperature=0)
    calls, finish = _streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and [json.loads(c["arguments"]) for c in calls.values()] == \
        [{"city": "Paris"}, {"city": "Oslo"}]
    whole = client.chat.completions.create(**ask)
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == \
        [c["arguments"] for c in calls.values()]
    paris = calls[0]["arguments"]
    # A call cut inside its arguments by max_tokens keeps what was written and finish_reason "length", streamed
    # or not.
    for n in range(16, 40):
        whole = client.chat.completions.create(**{**ask, "max_tokens": n})
        if whole.choices[0].message.tool_calls:
            break
    assert whole.choices[0].finish_reason == "length", n
    cut = whole.choices[0].message.tool_calls[0].function.arguments
    assert cut != paris and paris.startswith(cut)  # greedy: the same call, cut short
    calls, finish = _streamed_calls(client.chat.completions.create(**{**ask, "max_tokens": n}, stream=True))
    assert finish == "length" and calls == {0: {"name": "get_weather", "arguments": cut}}


def test_tool_calls_parse_streamed_or_not_and_results_go_back(chat_server):
    """SmolLM2's template knows no tools: they are described in a system message, and the grammar makes the
    forced call parse; the result goes back as a `role: tool` message and the model answers in text."""
    client = chat_server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        ask = dict(model=model, messages=messages, tools=WEATHER, tool_choice=choice, max_tokens=80, temperature=0,
                   parallel_tool_calls=False)
        whole = client.chat.completions.create(**ask)
        assert len(whole.choices[0].message.tool_calls) == 1  # one call: parallel_tool_calls is off
        call = whole.choices[0].message.tool_calls[0]
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
        calls, finish = _streamed_calls(client.chat.completions.create(**ask, stream=True))
        assert finish == "tool_calls"
        assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    answer = client.chat.completions.create(model=model, tools=WEATHER, max_tokens=30, temperature=0, messages=[
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'}],
        tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # `auto`: this small model answers in text; the lazy grammar waits for a marker that never comes, and the text
    # streams as it does without tools.
    ask = dict(model=model, messages=messages, tools=WEATHER, tool_choice="auto", max_tokens=30, temperature=0)
    text = client.chat.completions.create(**ask)
    assert text.choices[0].message.content and not text.choices[0].message.tool_calls
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **ask, stream=True) if chunk.choices)
    assert streamed == text.choices[0].message.content
