"""llama-server's dialect on a live `localspec serve` (the demo-chat pair): its endpoints, field names and types as
the pinned llama.cpp's tools/server/README.md gives them, its native request fields, and the small behaviours its
clients rely on (timings on the usage chunk, the context error's numbers, CORS for credentialed requests).

Every wait is bounded in time; every loop in count.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from localspec.config import load_preset
from localspec.rounds.events import collect
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_serve import FIM_TOKENS
from tests.test_serve import Server, run_cli

pytestmark = pytest.mark.slow

KEY = "sekrit-test-key"
PROMPT = "The three primary colours are"
N = 16
PREFIX = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"
SUFFIX = "\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def server(demo_home, tmp_path_factory) -> Iterator[Server]:
    s = Server(demo_home, tmp_path_factory.mktemp("serve-llama"), "--always-draft",
               "--pair", "demo-chat", "--parallel", "2",
               "--metrics", "--cors-origin", "*", "--model-alias", "x", "--threads", "1")  # the tests' clients name "x"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(demo_home, tmp_path_factory) -> Iterator[Server]:
    """An API key, metrics off (the default), the Gemma 3 demo pair (no FIM tokens)."""
    s = Server(demo_home, tmp_path_factory.mktemp("serve-llama-key"), "--always-draft",
               "--api-key", KEY, "--model-alias", "x",
               "--threads", "1")
    yield s
    s.stop()


def post(server: Server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.root}{path}", json=body, timeout=600, **kw)


def get(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{server.root}{path}", timeout=60, **kw)


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# -- /tokenize, /detokenize, /apply-template -----------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_with_llama_server_fields(server):
    text = "Hello world, llamas 🦙!"
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids and all(type(t) is int for t in ids)
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and all(set(p) == {"id", "piece"} for p in pieces)
    assert all(isinstance(p["piece"], str) or all(type(b) is int for b in p["piece"]) for p in pieces)
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes, split over tokens
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == text.encode()
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}
    # parse_special (default true): a control token written in the text is one token; false: plain text.
    special = post(server, "/tokenize", {"content": "<|im_start|>"}).json()["tokens"]
    plain = post(server, "/tokenize", {"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    assert len(special) == 1 and len(plain) > 1
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    typo = post(server, "/tokenize", {"content": "x", "with_piece": True})
    assert typo.status_code == 400 and "with_piece" in typo.json()["error"]["message"]


def test_apply_template_gives_the_prompt_a_chat_request_runs(server):
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}]
    prompt = post(server, "/apply-template", {"messages": messages}).json()["prompt"]
    assert isinstance(prompt, str) and "Name a colour." in prompt and prompt.count("<|im_start|>") == 3
    tokens = post(server, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    chat = server.client().chat.completions.create(model="x", messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(tokens)


# -- /props, /slots, /metrics --------------------------------------------------------------------------------


def test_props_has_llama_server_fields_and_localspec_own(server):
    props = get(server, "/props").json()
    settings = props["default_generation_settings"]
    assert type(settings["n_ctx"]) is int and settings["n_ctx"] > 0 and settings["speculative"] is True
    params = settings["params"]
    assert type(params["temperature"]) is float and type(params["top_k"]) is int
    assert type(params["speculative.n_max"]) is int and type(params["speculative.p_min"]) is float
    assert params["n_predict"] == -1 and params["samplers"][-1] == "temperature"
    assert props["total_slots"] == 2 and props["model_path"].endswith(".gguf")
    assert "<|im_start|>" in props["chat_template"] and props["endpoint_metrics"] is True
    assert isinstance(props["build_info"], str) and props["modalities"]["vision"] is False
    own = props["localspec"]
    # The drafter is the engine's (drafters.build): the preset's default, and what a request may choose instead.
    assert own["draft_model"].endswith(".gguf") and own["drafter"] == "model"
    assert own["drafters"] == ["chain", "lookup", "model", "suffix"] and params["speculative.type"] == "draft-simple"
    assert own["speculative.n_max"] == params["speculative.n_max"] and type(own["acceptance_rate"]) is float


def test_slots_show_the_pinned_request_its_prompt_and_acceptance(server):
    server.wait_idle()
    done = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0, "id_slot": 1}).json()
    assert done["id_slot"] == 1
    slots = get(server, "/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    one = slots[1]
    assert one["is_processing"] is False and type(one["id_task"]) is int and one["id_task"] >= 0
    assert one["n_prompt_tokens"] == done["tokens_evaluated"]
    assert one["n_prompt_tokens_cache"] + one["n_prompt_tokens_processed"] == one["n_prompt_tokens"]
    assert one["next_token"][0]["n_decoded"] == N and one["params"]["n_predict"] == N
    assert one["timings"]["draft_n_accepted"] == done["timings"]["draft_n_accepted"]
    assert one["n_tokens"] >= done["tokens_evaluated"] + N - 1  # tokens in its context
    again = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0, "id_slot": 1}).json()
    assert again["content"] == done["content"] and again["tokens_cached"] == done["tokens_evaluated"] - 1
    assert get(server, "/slots").json()[1]["n_prompt_tokens_cache"] == done["tokens_evaluated"] - 1
    missing = post(server, "/completion", {"prompt": PROMPT, "id_slot": 2})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "id_slot"


def test_slots_show_a_running_request_and_fail_on_no_slot(server):
    server.wait_idle()
    client = server.client()
    streams = [client.completions.create(model="x", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
               for _ in range(2)]
    try:
        for s in streams:
            next(iter(s))
        slots = get(server, "/slots").json()
        assert all(s["is_processing"] for s in slots)
        assert all(s["next_token"][0]["has_next_token"] for s in slots)
        assert get(server, "/slots?fail_on_no_slot=1").status_code == 503
    finally:
        for s in streams:
            s.close()
    server.wait_idle()
    assert get(server, "/slots?fail_on_no_slot=1").status_code == 200


def metrics_of(server: Server) -> dict[str, float]:
    r = get(server, "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#"):
            assert line.split()[1] in ("HELP", "TYPE")
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def test_metrics_count_tokens_drafts_and_requests(server):
    server.wait_idle()
    before = metrics_of(server)
    done = server.client().completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    server.wait_idle()
    after = metrics_of(server)
    timings = done.model_extra["timings"]
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == N
    # The prompt as the reply's timings count it (the real model's side of test_serve_fast's metrics test).
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == timings["prompt_n"]
    assert (after["llamacpp:prompt_tokens_cached_total"]
            - before["llamacpp:prompt_tokens_cached_total"]) == timings["cache_n"]
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert (after["llamacpp:spec_decode_num_draft_tokens_total"]
            - before["llamacpp:spec_decode_num_draft_tokens_total"]) == timings["draft_n"]
    assert (after["llamacpp:spec_decode_num_accepted_tokens_total"]
            - before["llamacpp:spec_decode_num_accepted_tokens_total"]) == timings["draft_n_accepted"]
    served = 'localspec:requests_total{outcome="served"}'
    assert after[served] == before[served] + 1
    assert after["llamacpp:requests_processing"] == 0 and after["localspec:slots"] == 2
    assert 0 <= after["localspec:draft_acceptance_ratio"] <= 1


def test_new_endpoints_keep_the_key_rule_and_metrics_stay_off_by_default(keyed):
    for method, path in (("GET", "/props"), ("GET", "/slots"), ("GET", "/metrics"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("POST", "/apply-template"), ("POST", "/completion"),
                         ("POST", "/infill")):
        r = httpx.request(method, f"{keyed.root}{path}", json={}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    auth = {"Authorization": f"Bearer {KEY}"}
    off = get(keyed, "/metrics", headers=auth)
    assert off.status_code == 501 and "--metrics" in off.json()["error"]["message"]
    assert get(keyed, "/props", headers=auth).json()["endpoint_metrics"] is False


# -- the native /completion route and fields -----------------------------------------------------------------


def test_native_completion_shape_equals_generate(server, demo_home):
    want = run_cli(demo_home, "generate", PROMPT, "--pair", "demo-chat", "--temp", "0", "--max-tokens", str(N))
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0}).json()
    assert whole["content"] == want and whole["stop"] is True and whole["stop_type"] == "limit"
    assert whole["tokens_predicted"] == N and type(whole["tokens_evaluated"]) is int
    assert whole["generation_settings"]["n_predict"] == N and whole["stopping_word"] == ""
    assert whole["timings"]["predicted_n"] == N and PROMPT in whole["prompt"]
    with httpx.stream("POST", f"{server.root}/completion", timeout=600,
                      json={"prompt": PROMPT, "n_predict": N, "temperature": 0, "stream": True}) as r:
        events = sse_events(r)
    assert "[DONE]" not in events  # llama-server's native stream has none
    chunks = [json.loads(e) for e in events]
    assert "".join(c["content"] for c in chunks) == want
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["timings"]["predicted_n"] == N and chunks[-1]["stop_type"] == "limit"
    word = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                        "stop": [want[3:6]]}).json()
    assert word["stop_type"] == "word" and word["stopping_word"] == want[3:6] and word["content"] == want[:3]


def test_native_fields_on_the_openai_routes(server):
    client = server.client()
    kw = dict(model="x", prompt=PROMPT, temperature=0)
    assert client.completions.create(**kw, extra_body={"n_predict": 5}).usage.completion_tokens == 5
    assert client.completions.create(**kw, max_tokens=5, extra_body={"n_predict": 5}).usage.completion_tokens == 5
    flat = client.completions.create(**kw, max_tokens=8, extra_body={"speculative.n_max": 0, "cache_prompt": False})
    assert flat.model_extra["timings"]["draft_n"] == 0
    off = client.completions.create(**kw, max_tokens=8, extra_body={"speculative.type": "none"})
    assert off.model_extra["timings"]["draft_n"] == 0 and off.choices[0].text == flat.choices[0].text
    lookup = client.completions.create(**kw, max_tokens=8, extra_body={"speculative.type": "ngram-simple"})
    assert lookup.choices[0].text == flat.choices[0].text  # greedy: whoever drafts, the target's tokens
    # llama.cpp front-ends send every sampler's settings at their off values: accepted.
    defaults = {"typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "dry_multiplier": 0.0,
                "dry_base": 1.75, "dry_sequence_breakers": ["\n"], "xtc_probability": 0, "xtc_threshold": 0.1,
                "n_probs": 0, "ignore_eos": False, "n_keep": 0, "id_slot": -1, "timings_per_token": False}
    assert client.completions.create(**kw, max_tokens=2, extra_body=defaults).usage.completion_tokens == 2
    for body, param in (({"n_predict": 5, "max_tokens": 6}, "n_predict"), ({"n_probs": 3}, "n_probs"),
                        ({"mirostat": 2}, "mirostat"), ({"speculative.n_max": 2, "speculative": {"n_max": 3}},
                                                         "speculative.n_max"),
                        ({"speculative.type": "ngram"}, "speculative.type"), ({"n_predict": 0}, "n_predict"),
                        ({"speculative.type": "none", "speculative": {"type": "ngram-simple"}},
                         "speculative.type"),
                        ({"speculative.n_max": -1}, "speculative.n_max"), ({"n_predictt": 3}, "n_predictt")):
        r = post(server, "/v1/completions", {"prompt": PROMPT, **body})
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_timings_per_token_and_on_the_usage_chunk(server):
    chunks = list(server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"timings_per_token": True}))
    usage = chunks[-1]
    assert usage.choices == [] and usage.model_extra["timings"]["predicted_n"] == usage.usage.completion_tokens
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and all(type(c.model_extra["timings"]["predicted_n"]) is int for c in content)
    counts = [c.model_extra["timings"]["predicted_n"] for c in content]
    assert counts == sorted(counts) and counts[-1] <= N


@pytest.mark.parametrize("prompt", ["word " * 5000, [1] * 5000, "word"], ids=["text", "ids", "chat"])
def test_context_overflow_carries_llama_cpp_type_and_numbers(server, prompt):
    """Every way a prompt is found too long (counted while tokenizing, as ids, as messages) says it alike."""
    if prompt == "word":
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word"}] * 5000})
    else:
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["type"] == "exceed_context_size_error"
    assert type(error["n_prompt_tokens"]) is int and error["n_prompt_tokens"] >= error["n_ctx"] > 0


def test_cors_star_echoes_the_origin_with_credentials(server):
    origin = "http://ui.example:3000"
    preflight = httpx.options(f"{server.url}/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == origin
    assert preflight.headers["access-control-allow-credentials"] == "true"
    simple = get(server, "/props", headers={"Origin": origin})
    assert simple.headers["access-control-allow-origin"] == origin
    assert simple.headers["access-control-allow-credentials"] == "true"


# -- fill-in-the-middle --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fim_server(demo_home, tiny_fim_pair, tmp_path_factory) -> Iterator[Server]:
    target, draft = tiny_fim_pair
    s = Server(demo_home, tmp_path_factory.mktemp("serve-fim"), "--always-draft",
               "--target", str(target), "--draft", str(draft),
               "--ctx", "512", "--model-alias", "x")
    yield s
    s.stop()


def plain_fim_reference(target, prefix: str, suffix: str, n: int) -> str:
    """Plain decoding of the target alone (no draft loaded) on the FIM prompt built from the ids the GGUF names
    (FIM_TOKENS), not from llama.cpp's FIM API or the server's prompt builder."""
    greedy = load_preset("greedy").with_overrides(n_ctx=512, n_draft=0)
    with open_session(ModelFiles(target=target, draft=None, name="custom"), greedy) as local:
        model = local.target

        def code(text: str) -> list[int]:
            return model.tokenize(text, add_special=False, parse_special=False)

        pre, suf, mid = FIM_TOKENS
        prompt = ([model.bos] if model.add_bos else []) + [pre, *code(prefix), suf, *code(suffix), mid]
        gen = collect(local.engine.generate(prompt, greedy.sampling, greedy.draft, n))
        return model.detokenize(gen.tokens)


def test_infill_and_suffix_are_lossless_against_plain_decoding(fim_server, tiny_fim_pair):
    want = plain_fim_reference(tiny_fim_pair[0], PREFIX, SUFFIX, N)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": N, "temperature": 0}
    spec = post(fim_server, "/infill", body).json()
    assert spec["content"] == want and spec["timings"]["draft_n"] > 0  # speculation stayed on
    assert spec["tokens_predicted"] == N and spec["stop"] is True
    plain = post(fim_server, "/infill", {**body, "speculative.n_max": 0}).json()
    assert plain["content"] == want and plain["timings"]["draft_n"] == 0
    suffix = fim_server.client().completions.create(model="x", prompt=PREFIX, suffix=SUFFIX, max_tokens=N,
                                                    temperature=0)
    assert suffix.choices[0].text == want
    extra = post(fim_server, "/infill", {**body, "input_extra": [{"filename": "util.py", "text": "import math\n"}]})
    assert extra.status_code == 200 and extra.json()["prompt"].count("import math") == 1
    assert get(fim_server, "/props").json()["localspec"]["fim"] is True
    bad = post(fim_server, "/infill", {**body, "input_extra": [{"name": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input_extra[0]")


def test_infill_on_a_model_without_fim_tokens_is_a_clear_400(server):
    r = post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_fim_tokens"
    assert "FIM_PRE" in r.json()["error"]["message"]
    v1 = post(server, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX})
    assert v1.status_code == 400 and v1.json()["error"]["code"] == "no_fim_tokens"
    assert get(server, "/props").json()["localspec"]["fim"] is False


def test_concurrent_native_and_openai_requests_get_what_each_gets_alone(server):
    """The native route runs through the same slots: two at once (one pinned) give what each gives alone."""
    server.wait_idle()
    got, alone = alone_and_together(server)
    assert got == {0: alone[0], 1: alone[1]}


def alone_and_together(server: Server) -> tuple[dict[int, str], list[str]]:
    """Two greedy native requests, each alone, then both at once pinned to slots 0 and 1: (together by slot,
    alone). Each reply's `prompt` field is detokenized on the event loop while the other reply's tokens become text
    on the engine thread (tests/test_piece_threads.py)."""
    alone = [post(server, "/completion", {"prompt": p, "n_predict": N, "temperature": 0}).json()["content"]
             for p in (PROMPT, "Once upon a time")]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        body = {"prompt": (PROMPT, "Once upon a time")[i], "n_predict": N, "temperature": 0, "id_slot": i}
        got[i] = post(server, "/completion", body).json()["content"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=600)
    assert time.monotonic() - t0 < 600
    return got, alone


# -- n > 1 ---------------------------------------------------------------------------------------------------


def test_n_choices_run_in_slots_each_with_its_own_seed(server):
    """`--parallel 2`, n = 3: two choices run together, the third after; choice i is the reply of seed + i alone
    (no drafting here: with several slots the draft length adapts to the load, which moves a seed's draws)."""
    server.wait_idle()
    client = server.client()
    kw = dict(model="x", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=1.0)
    extra = {"speculative.n_max": 0}
    alone = [client.chat.completions.create(**kw, seed=7 + i, extra_body=extra).choices[0].message.content
             for i in range(3)]
    assert len(set(alone)) > 1  # the seeds differ
    many = client.chat.completions.create(**kw, seed=7, n=3, extra_body=extra)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == alone
    assert many.usage.completion_tokens == many.model_extra["timings"]["predicted_n"] >= 3
    chunks = list(client.chat.completions.create(**kw, seed=7, n=3, stream=True, extra_body=extra))
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == alone
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    native = post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 8, "temperature": 1.0,
                                          "seed": 3, "n_cmpl": 2, "speculative.n_max": 0}).json()
    assert isinstance(native, list) and [r["index"] for r in native] == [0, 1]


def test_n_choices_on_one_slot_run_one_after_another(keyed):
    """`--parallel 1`: the choices queue behind each other in the one slot, drafting as usual; each is what its
    seed gives alone."""
    client = keyed.client(KEY)
    kw = dict(model="x", prompt=PROMPT, max_tokens=12, temperature=0.8)
    alone = [client.completions.create(**kw, seed=11 + i).choices[0].text for i in range(2)]
    both = client.completions.create(**kw, seed=11, n=2)
    assert [c.text for c in both.choices] == alone and both.model_extra["timings"]["draft_n"] > 0
    too_many = post(keyed, "/v1/completions", {"prompt": PROMPT, "n": 64},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
