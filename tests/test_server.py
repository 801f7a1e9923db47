"""The server in-process, over the real demo pair: the worker's stop handling and counts, the request schema's
400s, and a hypothesis fuzz of both generation routes (no 500, no traceback, still serving afterwards).

The live server with the official `openai` client is tests/test_serve.py.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from localspec.config import load_preset
from localspec.server.app import Backend, ServerState, create_app
from localspec.server.errors import ApiError
from localspec.server.schema import ChatRequest, CompletionRequest, parse
from localspec.server.worker import FINISH_STOP, Delta, Failed, Finished, Job, Worker
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_serve import PROMPT, demo_files, find_stop_in_draft_run

# (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
GREEDY = load_preset("greedy").with_overrides(n_ctx=512, stand_aside=False)


@pytest.fixture(scope="module")
def session(demo_home):
    with open_session(demo_files(demo_home), GREEDY) as s:
        yield s


@pytest.fixture(scope="module")
def backend(session):
    b = Backend.build(session.engine, session.target, GREEDY, queue=4)
    yield b
    b.worker.shutdown(timeout=60)


def collect(worker: Worker, job_kwargs: dict, timeout: float = 300) -> tuple[list, object]:
    """Submit one job and wait for its end (bounded)."""
    items: queue.Queue = queue.Queue()
    job = Job(sink=items.put, **job_kwargs)
    worker.submit(job)
    deltas, deadline = [], time.monotonic() + timeout
    while True:
        item = items.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(item, Delta):
            deltas.append(item.text)
        else:
            return deltas, item


# -- the worker ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_inside_an_accepted_run_stops_the_engine_at_once(session, backend):
    prompt = session.target.tokenize(PROMPT)
    case = find_stop_in_draft_run(session.engine, prompt, GREEDY.sampling, GREEDY.draft, 40)
    deltas, end = collect(backend.worker, dict(prompt=prompt, sampling=GREEDY.sampling, drafting=GREEDY.draft,
                                               max_tokens=40, stops=("zzz-never", case.stop)))
    assert isinstance(end, Finished)
    result = end.result
    assert "".join(deltas) == result.text == case.text[: case.cut]  # nothing of the stop, nothing after it
    assert result.finish_reason == FINISH_STOP and result.stop_string == case.stop
    assert result.engine_tokens == case.tokens_through_stop  # no token generated past the one completing it
    counted = result.stats
    assert counted.tokens == case.returned_tokens < result.engine_tokens
    assert counted.accepted == case.returned_from_draft <= counted.tokens
    assert counted.accepted <= counted.drafted and counted.rounds == len(counted.draft_lengths)
    assert result.timings()["draft_n_accepted"] == counted.accepted


@pytest.mark.slow
def test_counts_without_a_stop_match_the_engine(session, backend):
    prompt = session.target.tokenize(PROMPT)
    events = list(session.engine.generate(prompt, GREEDY.sampling, GREEDY.draft, 12))  # (first: the job's cache)
    stats = events[-1].stats
    deltas, end = collect(backend.worker, dict(prompt=prompt, sampling=GREEDY.sampling, drafting=GREEDY.draft,
                                               max_tokens=12, stops=()))
    result = end.result
    assert "".join(deltas) == result.text == "".join(e.text for e in events[:-1])
    counted = result.stats
    assert (counted.tokens, counted.drafted, counted.accepted, counted.rounds) == (
        12, stats.drafted, stats.accepted, stats.rounds)
    assert result.prompt_n == 1 and counted.prompt_tokens == len(prompt)  # same prompt again: all of it cached


@pytest.mark.slow
def test_queue_is_bounded_fifo_and_cancel_frees_it(session, demo_home):
    prompt = session.target.tokenize(PROMPT)
    worker = Worker(session.engine, queue_size=1)
    worker.start()
    try:
        seen: dict[str, list] = collections.defaultdict(list)

        def job(name: str, n: int) -> Job:
            return Job(prompt=prompt, sampling=GREEDY.sampling, drafting=GREEDY.draft, max_tokens=n, stops=(),
                       sink=lambda item: seen[name].append(item))

        long, waiting, extra = job("long", 10_000), job("waiting", 2), job("extra", 2)
        worker.submit(long)
        deadline = time.monotonic() + 120
        while not seen["long"] and time.monotonic() < deadline:  # running: its first token arrived
            time.sleep(0.05)
        worker.submit(waiting)
        with pytest.raises(ApiError, match="busy"):
            worker.submit(extra)
        assert worker.stats.rejected == 1
        worker.cancel(long)
        deadline = time.monotonic() + 120
        while not any(isinstance(i, Finished) for i in seen["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(seen["long"][-1], Finished) and seen["long"][-1].result.finish_reason == "cancelled"
        assert isinstance(seen["waiting"][-1], Finished) and seen["waiting"][-1].result.stats.tokens == 2
        assert worker.stats.cancelled == 1 and worker.stats.served == 1
    finally:
        worker.shutdown(timeout=60)
    # after shutdown nothing is accepted, and a job still queued is told why
    with pytest.raises(ApiError, match="shutting down"):
        worker.submit(job("late", 1))


# -- the schema ----------------------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({**CHAT, "n": 65}, "n", "less than or equal to 64"),
    ({**CHAT, "n": 2, "n_cmpl": 3}, "n", "disagree"),
    ({**CHAT, "mirostat": 2}, "mirostat", "Mirostat sampling is not supported"),
    ({**CHAT, "speculative.p_min": 1.5}, "speculative.p_min", "less than or equal to 1"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions", "function calling"),
    ({**CHAT, "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ({**CHAT, "temprature": 0.5}, "temprature", "did you mean 'temperature'"),
    ({**CHAT, "temperature": "0.5"}, "temperature", "valid number"),
    ({**CHAT, "temperature": 6}, "temperature", "less than or equal to 5"),  # the preset's own range
    ({**CHAT, "speculative": {"n_max": 33}}, "speculative.n_max", "less than or equal to 32"),
    ({**CHAT, "stop": ["ok", ""]}, "stop", "must not be empty"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "got 'function'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "an image_url part is"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]},
     "messages[0].content", "picture URLs are not fetched"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content", "parts are text or image_url"),
    ({"messages": [{"role": "user", "content": "see <__media__>"}]}, "messages[0].content", "picture marker"),
    ({"messages": []}, "messages", "at least 1"),
    ({}, "messages", "required"),
])
def test_chat_schema_names_the_field(body, param, needle):
    with pytest.raises(ApiError) as info:
        parse(ChatRequest, body)
    assert info.value.param == param and needle in info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": 5}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "seed": -2}, "seed"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_completion_schema_names_the_field(body, param):
    with pytest.raises(ApiError) as info:
        parse(CompletionRequest, body)
    assert info.value.param == param


@pytest.mark.parametrize(("kind", "overrides"), [
    ("draft-simple", {"drafter": "model"}),
    ("ngram-simple", {"drafter": "lookup"}),
    ("ngram-simple,draft-simple", {"drafter": "chain"}),
    ("none", {"n_draft": 0}),
])
def test_speculative_type_is_llama_servers_name_for_a_drafter(kind, overrides):
    req = parse(ChatRequest, {**CHAT, "speculative": {"type": kind, "n_max": 4}})
    assert {k: v for k, v in req.preset_overrides().items() if k in ("drafter", "n_draft")} == {"n_draft": 4,
                                                                                             **overrides}


def test_flat_speculative_type_is_llama_servers_spelling_and_must_agree_with_the_nested_one():
    assert parse(ChatRequest, {**CHAT, "speculative.type": "ngram-simple"}).preset_overrides()["drafter"] == "lookup"
    assert parse(ChatRequest, {**CHAT, "speculative.type": "none",
                               "speculative.n_max": 4}).preset_overrides()["n_draft"] == 0
    same = parse(ChatRequest, {**CHAT, "speculative.type": "draft-simple", "speculative": {"type": "draft-simple"}})
    assert same.preset_overrides()["drafter"] == "model"
    with pytest.raises(ApiError) as info:
        parse(ChatRequest, {**CHAT, "speculative.type": "none", "speculative": {"type": "draft-simple"}})
    assert info.value.param == "speculative.type" and "disagree" in info.value.message
    with pytest.raises(ApiError) as info:
        parse(ChatRequest, {**CHAT, "speculative.type": "medusa"})
    assert info.value.param == "speculative.type"


def test_an_unknown_speculative_type_names_the_field():
    with pytest.raises(ApiError) as info:
        parse(ChatRequest, {**CHAT, "speculative": {"type": "medusa"}})
    assert info.value.param == "speculative.type" and "ngram-simple" in info.value.message


def test_neutral_values_of_unsupported_fields_are_accepted():
    """What front-ends send by default must not be refused."""
    req = parse(ChatRequest, {**CHAT, "n": 1, "logprobs": False, "tools": [], "tool_choice": "none",
                              "response_format": {"type": "text"}, "logit_bias": {}, "user": "u", "stop": "END",
                              "stream_options": {"include_usage": True}, "stream": True, "seed": -1,
                              "speculative": {"n_max": 0, "p_min": 0.5}, "max_completion_tokens": 7,
                              "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                           {"role": "user", "content": "b", "name": "me"},
                                           {"role": "assistant", "content": None, "tool_calls": []}]})
    assert req.stop == ("END",) and req.include_usage and req.limit() == 7
    assert req.preset_overrides()["n_draft"] == 0 and req.preset_overrides()["p_min"] == 0.5
    assert req.messages[0].as_template_message() == {"role": "system", "content": "a"}
    assert parse(CompletionRequest, {"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]


# -- the routes, in process ----------------------------------------------------------------------------------


def client_for(backend: Backend, **state: object) -> TestClient:
    s = ServerState(model_id="demo", **state)
    s.attach(backend)
    return TestClient(create_app(s), base_url="http://localhost", raise_server_exceptions=True)


@pytest.mark.slow
def test_health_reports_loading_then_ok(backend):
    s = ServerState(model_id="demo")
    with TestClient(create_app(s), base_url="http://localhost") as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        s.attach(backend)
        assert client.get("/health").json()["status"] == "ok"
        r = client.get("/nope")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
TEXT = st.text(max_size=30)
STOP = st.text(min_size=1, max_size=4)
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": TEXT})
ANY_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bot"]) | JSON_VALUES},
    optional={"content": TEXT | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2) | JSON_VALUES,
              "name": st.text(max_size=5), "tool_calls": JSON_VALUES},
)
# field → (values the server must accept, values near or past the edges; any JSON value is tried as well)
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.just("demo"), st.text(max_size=10) | JSON_VALUES),  # another name: 404 model_not_found
    "stream": (st.booleans(), st.integers(0, 1)),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=2)),
    "max_tokens": (st.integers(1, 40), st.integers(-3, 0) | st.floats(1, 3)),
    "temperature": (st.floats(0, 5), st.floats(-1, 7) | st.text(max_size=3)),
    "top_k": (st.integers(0, 100), st.integers(-5, 2_000_000)),
    "top_p": (st.floats(0, 1), st.floats(-1, 2)),
    "min_p": (st.floats(0, 1), st.floats(-1, 2)),
    "repeat_penalty": (st.floats(0.5, 2), st.floats(-1, 3)),
    "repeat_last_n": (st.integers(0, 64), st.integers(-5, 10_000)),
    "presence_penalty": (st.floats(-2, 2), st.floats(-5, 5)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-5, 5)),
    "seed": (st.integers(-1, 2**32 - 1), st.integers(-(2**40), 2**40)),
    "stop": (STOP | st.lists(STOP, max_size=3), st.lists(st.text(max_size=3), max_size=20)),
    "speculative": (st.fixed_dictionaries({}, optional={"n_max": st.integers(0, 8), "p_min": st.floats(0, 1)}),
                    st.dictionaries(st.sampled_from(["n_max", "p_min", "n_min"]), JSON_VALUES, max_size=3)),
    "n": (st.just(1), st.integers(0, 3)),
    "logprobs": (st.just(False), st.booleans() | st.integers(0, 3)),
    "user": (st.text(max_size=5), JSON_VALUES),
}
SPECIFIC = {
    "chat": {
        "messages": (st.lists(VALID_MESSAGE, min_size=1, max_size=3), st.lists(ANY_MESSAGE, max_size=3)),
        "max_completion_tokens": (st.integers(1, 40), st.integers(-3, 0)),
        "tools": (st.just([]), st.lists(JSON_VALUES, min_size=1, max_size=2)),
        "response_format": (st.just({"type": "text"}), st.fixed_dictionaries({"type": st.text(max_size=12)})),
    },
    "completions": {
        "prompt": (TEXT | st.lists(st.integers(0, 262_143), min_size=1, max_size=6),
                   st.lists(st.integers(-5, 300_000), max_size=6) | st.lists(st.text(max_size=10), max_size=2)),
        "echo": (st.just(False), st.booleans()),
        "suffix": (st.just(""), st.text(max_size=3)),
    },
}


@st.composite
def bodies(draw: st.DrawFn, route: str) -> dict:
    """Some fields present with values the server must accept; up to three of them replaced by values near or
    past the edges, or by any JSON value; sometimes an unknown field. Bodies with nothing hostile must pass."""
    fields = {**FIELDS, **SPECIFIC[route]}
    required = "messages" if route == "chat" else "prompt"
    present = [name for name in fields if name == required or draw(st.integers(0, 9)) < 3]
    hostile = set(draw(st.lists(st.sampled_from(present), max_size=3, unique=True)))
    if draw(st.integers(0, 2)) == 0:
        hostile = set()  # a third of the bodies are entirely valid
    body = {}
    for name in present:
        valid, edge = fields[name]
        body[name] = draw((edge | JSON_VALUES) if name in hostile else valid)
    if hostile and draw(st.integers(0, 4)) == 0:
        body.pop(required, None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(JSON_VALUES)
    return body


FUZZ_COUNTS: collections.Counter = collections.Counter()
FUZZ_EXAMPLES = int(os.environ.get("LOCALSPEC_FUZZ_EXAMPLES", "150"))  # more for a longer hunt


def check_response(r) -> None:
    FUZZ_COUNTS[r.status_code] += 1
    assert r.status_code in (200, 400, 404), r.text  # never a 500, never a 503 (one client at a time)
    if r.status_code == 404:  # a model this server does not serve, and nothing else
        assert r.json()["error"]["code"] == "model_not_found", r.text
        return
    if r.status_code == 400:
        error = r.json()["error"]
        numbers = {"n_prompt_tokens", "n_ctx"} if error["type"] == "exceed_context_size_error" else set()
        assert set(error) == {"message", "type", "param", "code"} | numbers and error["message"]
        assert "Traceback" not in error["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_fuzzed_requests_never_break_the_server(backend, capsys, caplog):
    # A cap of 2 tokens per reply keeps every accepted request short; the schema is what is under test.
    caplog.set_level(logging.WARNING)
    with client_for(backend, max_tokens=2) as client:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(route=st.sampled_from(["chat", "completions"]), data=st.data())
        def structured(route, data):
            body = data.draw(bodies(route))
            check_response(client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                                       json=body))

        @settings(max_examples=FUZZ_EXAMPLES * 2 // 3, deadline=None, database=None, derandomize=True)
        @given(route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/chat/completions"]),
               raw=st.binary(max_size=60) | st.sampled_from([b"NaN", b'{"prompt": NaN}', b"[" * 5000, b"{}",
                                                              b'{"prompt": "x", "max_tokens": 1e400}', b"null"]))
        def raw_bodies(route, raw):
            check_response(client.post(route, content=raw, headers={"content-type": "application/json"}))

        structured()
        raw_bodies()
        # still serving: a plain request works and the engine is idle
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        health = client.get("/health").json()
        assert health["status"] == "ok" and not health["busy"] and health["failed"] == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []  # nothing went wrong inside
    with capsys.disabled():
        print(f"\nfuzz: {sum(FUZZ_COUNTS.values())} requests, by status {dict(sorted(FUZZ_COUNTS.items()))}")
    assert FUZZ_COUNTS[200] >= 20 and FUZZ_COUNTS[400] >= 50  # both paths were exercised


@pytest.mark.slow
def test_disconnected_non_streaming_client_cancels_its_job(backend):
    """A client waiting for a JSON reply that goes away frees the engine (TestClient's disconnect is the end of
    the response, so this drives the route's watcher directly through an ASGI call that disconnects at once)."""
    import asyncio

    s = ServerState(model_id="demo")
    s.attach(backend)
    app = create_app(s)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5000}).encode()
    sent = []

    async def call() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(1.0)  # the client leaves a second into generation
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json")], "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "http_version": "1.1", "asgi": {"version": "3.0"}}
        await asyncio.wait_for(app(scope, receive, send), timeout=300)

    before = backend.worker.stats.cancelled
    t0 = time.monotonic()
    asyncio.run(call())
    deadline = time.monotonic() + 120
    while backend.worker.stats.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not backend.worker.stats.busy and backend.worker.stats.cancelled == before + 1
    assert time.monotonic() - t0 < 120  # 5000 tokens would take far longer: it was stopped


@pytest.mark.slow
def test_shutdown_fails_queued_jobs_with_a_reason(session):
    worker = Worker(session.engine, queue_size=2)  # never started: jobs stay queued
    got: list = []
    job = Job(prompt=[1], sampling=GREEDY.sampling, drafting=GREEDY.draft, max_tokens=1, stops=(), sink=got.append)
    worker.submit(job)
    worker.shutdown(timeout=0)
    assert isinstance(got[0], Failed) and got[0].error.code == "shutdown"



def test_listening_address_checks():
    """The warning for a server reachable from other machines rests on this; a busy port is a one-line error."""
    from localspec.cli.serve_cmd import is_loopback, listen
    from localspec.errors import LocalspecError

    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.5")
    sock = listen("127.0.0.1", 0)
    try:
        with pytest.raises(LocalspecError, match=r"cannot listen on 127\.0\.0\.1:\d+: .*try another --port"):
            listen("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


@pytest.mark.slow
def test_status_line_counts_slots_and_says_when_they_take_turns(demo_home, tiny_pair):
    """The live line of `serve --parallel N`: running/slots while generating, and a note when llama.cpp's
    multi-sequence batches are not exact for the model (Gemma 3, the demo) so its slots decode in turns."""
    from localspec.cli.serve_cmd import _status

    for files, turns in ((demo_files(demo_home), True),
                         (ModelFiles(target=tiny_pair[0], draft=tiny_pair[1], name="tiny"), False)):
        with open_session(files, GREEDY, parallel=2) as s:
            state = ServerState(model_id="demo")
            state.attach(Backend.build(s.engine, s.target, GREEDY, queue=1))
            try:
                line = _status(state, files).plain
                assert line.startswith("● ready") and ("slots take turns" in line) == turns, line
                state.backend.worker.stats.busy, state.backend.worker.stats.running = True, 1
                assert "generating 1/2" in _status(state, files).plain
            finally:
                state.backend.worker.shutdown()


@pytest.mark.slow
def test_several_choices_with_logprobs_or_tools_and_native_logprobs_are_refused_by_name(backend):
    """A reply's tool scanner and logprob offsets are one choice's: n > 1 with them is a 400 naming n, never a
    mixed-up reply; llama-server's /completion shape has no place for OpenAI logprobs."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with client_for(backend) as client:
        for route, body in (("/v1/completions", {"prompt": "x", "n": 2, "logprobs": 1}),
                            ("/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True}),
                            ("/v1/chat/completions", {**CHAT, "n": 2, "tools": [tool]})):
            r = client.post(route, json={**body, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", (body, r.text)
        r = client.post("/completion", json={"prompt": "x", "logprobs": 1, "n_predict": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    with client_for(backend, strict_model=True) as client:  # (any name means the one model otherwise)
        r = client.post("/completion", json={"prompt": "x", "model": "gpt-4o", "n_predict": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    with client_for(backend) as client:
        # grammar (main's #20) holds on the native route too
        r = client.post("/completion", json={"prompt": "x", "n_predict": 4, "grammar": 'root ::= "ab"'})
        assert r.status_code == 200 and r.json()["content"] == "ab", r.text
