"""Several pairs behind one endpoint (server/router.py) over scripted fake pairs: which pair a request's `model`
picks, loading on demand, unloading least recently used / idle within a budget, 503 when nothing fits, a busy pair
never unloaded under its request, /models/load and /models/unload. A live uvicorn server and the official `openai`
client; no llama.cpp model is loaded (tests/test_router.py does the same on the demo pairs)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from localspec.config import ServerSettings, load_preset
from localspec.rounds.engine import Engine
from localspec.rounds.prompt_cache import CacheBudget, ModelState, PromptCache, SlotState
from localspec.server.app import create_app
from localspec.server.handling import Backend, ServerState
from localspec.server.router import Loaded, PairRouter, ServedPair, shared_cache
from localspec.sessions.session import ModelFiles
from tests.helpers_hub import cache_file
from tests.helpers_serve import FakeTextModel, fake_backend, live_server, wait_for

MiB = 1 << 20
PRESET = load_preset("greedy").with_overrides(n_ctx=256)


class FakeLoader:
    """Each pair a FakeTextModel pair of its own (its seed: a text of its own); counts loads and frees, and remembers
    whether a pair was ever freed while a request held it."""

    def __init__(self, delay: float = 0.0, fits: bool = True) -> None:
        self.delay = delay
        self.fits = fits
        self.leaks: set[str] = set()  # pairs whose close reports its models left loaded (a thread that did not end)
        self.events: list[tuple[str, str]] = []
        self.router: PairRouter | None = None
        self.freed_while_held: list[str] = []

    def load(self, pair: ServedPair) -> Loaded:
        seed = 3 + list(self.router.pairs).index(pair.name)  # type: ignore[union-attr]
        target = FakeTextModel(vocab=16, seed=seed, n_ctx=256, delay=self.delay, device_top_k=64)
        draft = FakeTextModel(vocab=16, seed=seed, noise=1.0, n_ctx=256, name="fake-draft.gguf")
        backend = Backend.build(Engine(target, draft), target, PRESET, 4)  # type: ignore[arg-type]
        backend.model_id = pair.name
        self.events.append(("load", pair.name))

        def close() -> bool:
            if pair.leases:
                self.freed_while_held.append(pair.name)
            ended = backend.worker.shutdown(timeout=30)
            self.events.append(("unload", pair.name))
            return ended and pair.name not in self.leaks

        return Loaded(backend, close)

    def shortfall(self, pair: ServedPair) -> str | None:
        return None if self.fits else "needs 9.0 GiB of VRAM on GPU 0, 1.0 GiB free there"


def _pair(name: str, mib: int) -> ServedPair:
    files = ModelFiles(target=Path(f"{name}.gguf"), draft=Path(f"{name}-draft.gguf"), name=name)
    return ServedPair(name=name, files=files, preset=PRESET, footprint=mib * MiB)


@contextmanager
def routed(*, budget_mib: int | None = 1000, sizes: tuple[int, ...] = (600, 600), idle_s: float = 0.0,
           delay: float = 0.0, fits: bool = True) -> Iterator[tuple[str, PairRouter, FakeLoader]]:
    loader = FakeLoader(delay, fits)
    router = PairRouter([_pair(n, s) for n, s in zip(("alpha", "beta", "gamma"), sizes, strict=False)], loader,
                        budget=None if budget_mib is None else budget_mib * MiB, idle_s=idle_s)
    loader.router = router
    state = ServerState(model_id="alpha", router=router)
    try:
        with live_server(create_app(state)) as url:
            yield url, router, loader
    finally:
        router.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _complete(url: str, model: str, prompt: str = "hello", n: int = 12) -> str:
    r = _client(url).completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _status(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def _alone(name: str, prompt: str = "hello", n: int = 12) -> str:
    """The text a pair gives served alone (the one-pair server of before)."""
    seed = {"alpha": 3, "beta": 4}[name]
    target = FakeTextModel(vocab=16, seed=seed, n_ctx=256, device_top_k=64)
    draft = FakeTextModel(vocab=16, seed=seed, noise=1.0, n_ctx=256, name="fake-draft.gguf")
    backend = Backend.build(Engine(target, draft), target, PRESET, 4)  # type: ignore[arg-type]
    state = ServerState(model_id=name)
    state.attach(backend)
    try:
        with live_server(create_app(state)) as url:
            return _complete(url, name, prompt, n)
    finally:
        backend.worker.shutdown(timeout=30)


def test_models_lists_every_pair_with_its_status_and_a_request_loads_the_one_it_names() -> None:
    with routed(budget_mib=None) as (url, router, loader):
        listed = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
        assert all(m["object"] == "model" for m in listed["data"])
        assert _status(url) == {"alpha": "unloaded", "beta": "unloaded"}
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # the router answers before any pair loads
        texts = {name: _complete(url, name) for name in ("alpha", "beta")}
        assert _status(url) == {"alpha": "loaded", "beta": "loaded"}  # no budget, memory fits: both stay
        assert texts == {name: _alone(name) for name in texts}
        assert texts["alpha"] != texts["beta"]  # the request really went to the pair it named
        assert loader.events == [("load", "alpha"), ("load", "beta")]


def test_a_budget_for_one_pair_swaps_them_least_recently_used_first() -> None:
    with routed(budget_mib=1000, sizes=(600, 600, 300)) as (url, router, loader):
        _complete(url, "alpha")
        _complete(url, "gamma")  # 600 + 300 fit together
        assert _status(url) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        _complete(url, "alpha")  # alpha is now the more recent
        _complete(url, "beta")  # 600 more: gamma (least recently used) goes first, then alpha too
        assert _status(url) == {"alpha": "unloaded", "beta": "loaded", "gamma": "unloaded"}
        assert loader.events[2:] == [("unload", "gamma"), ("unload", "alpha"), ("load", "beta")]


def test_a_pair_left_loaded_at_its_unload_still_counts_against_the_budget() -> None:
    """A pair whose engine thread did not end keeps its models (never freed under a decode): its memory is still
    taken, so the router must not load another pair into it."""
    with routed(budget_mib=1000, sizes=(600, 600, 300)) as (url, router, loader):
        loader.leaks.add("alpha")
        _complete(url, "alpha")
        with pytest.raises(openai.APIStatusError) as refused:
            _complete(url, "beta")  # alpha unloaded to make room, but left loaded: its 600 MiB are still taken
        assert refused.value.status_code == 503 and "beta" in str(refused.value)
        assert _status(url)["beta"] == "unloaded"
        _complete(url, "gamma")  # 300 fits beside the leaked 600
        assert router.leaked == 600 * MiB


def test_a_pair_larger_than_the_budget_is_a_503_naming_it_and_the_server_goes_on() -> None:
    with routed(budget_mib=500, sizes=(600, 400)) as (url, router, loader):
        with pytest.raises(openai.APIStatusError) as failed:
            _complete(url, "alpha")
        assert failed.value.status_code == 503
        message = failed.value.body["message"]  # type: ignore[index]
        assert "'alpha'" in message and "models_budget = 500 MiB" in message
        assert _complete(url, "beta")  # the other still serves
        assert loader.events == [("load", "beta")]


def test_memory_that_does_not_fit_is_a_503_with_the_estimates_words() -> None:
    with routed(budget_mib=None, fits=False) as (url, router, loader):
        r = httpx.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert "needs 9.0 GiB of VRAM on GPU 0" in r.json()["error"]["message"]
        assert loader.events == []


def test_a_busy_pair_is_never_unloaded_for_another_which_waits_for_its_room() -> None:
    with routed(budget_mib=1000, delay=0.05) as (url, router, loader):
        long = ThreadPoolExecutor(1).submit(_complete, url, "alpha", "hello", 40)
        wait_for(lambda: router.pairs["alpha"].leases == 1)
        other = ThreadPoolExecutor(1).submit(_complete, url, "beta", "hi", 4)
        wait_for(lambda: _status(url)["alpha"] == "unloading")  # drains: takes no new requests
        assert not other.done()
        assert long.result(timeout=60) == _alone("alpha", "hello", 40)
        assert other.result(timeout=60) == _alone("beta", "hi", 4)
        assert loader.freed_while_held == []
        assert loader.events == [("load", "alpha"), ("unload", "alpha"), ("load", "beta")]


def test_unloading_a_busy_pair_is_deferred_until_its_request_ends() -> None:
    with routed(budget_mib=None, delay=0.05) as (url, router, loader):
        stream = _client(url).completions.create(model="alpha", prompt="hello", max_tokens=40, temperature=0,
                                                 stream=True)
        chunks = iter(stream)
        first = next(chunks).choices[0].text
        r = httpx.post(f"{url}/models/unload", json={"model": "alpha"})
        assert r.status_code == 200 and r.json() == {"success": True, "deferred": True, "requests": 1}
        assert _status(url)["alpha"] == "unloading"
        text = first + "".join(c.choices[0].text for c in chunks)
        assert text == _alone("alpha", "hello", 40)  # the stream ran to its end
        wait_for(lambda: _status(url)["alpha"] == "unloaded")
        assert loader.freed_while_held == [] and loader.events == [("load", "alpha"), ("unload", "alpha")]
        assert _complete(url, "alpha")  # a later request loads it again


def test_a_client_that_leaves_mid_stream_lets_its_pair_go() -> None:
    # (each decode 0.2 s: the reply outlasts a busy machine's pause between its first line and the check)
    with routed(budget_mib=None, delay=0.2) as (url, router, loader):
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 200,
                                                                  "stream": True}) as r:
            lines = r.iter_lines()  # held: a dropped line iterator closes the connection (httpx closes it when
            next(lines)              # the generator is collected), and a reset then ends the stream before the check
            assert router.pairs["alpha"].leases == 1
        wait_for(lambda: router.pairs["alpha"].leases == 0)
        assert httpx.post(f"{url}/models/unload", json={"model": "alpha"}).json() == {"success": True}
        assert loader.freed_while_held == []


def test_models_load_and_unload_answer_as_llama_servers_router() -> None:
    with routed(budget_mib=None) as (url, router, loader):
        assert httpx.post(f"{url}/models/load", json={"model": "beta"}).json() == {"success": True}
        assert _status(url) == {"alpha": "unloaded", "beta": "loaded"}
        again = httpx.post(f"{url}/models/load", json={"model": "beta"})
        assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
        assert httpx.post(f"{url}/models/unload", json={"model": "beta"}).json() == {"success": True}
        assert _status(url)["beta"] == "unloaded"
        gone = httpx.post(f"{url}/models/unload", json={"model": "beta"})
        assert gone.status_code == 400 and "not running" in gone.json()["error"]["message"]
        unknown = httpx.post(f"{url}/models/load", json={"model": "delta"})
        assert unknown.status_code == 404 and "'alpha', 'beta'" in unknown.json()["error"]["message"]
        bad = httpx.post(f"{url}/models/load", json={"name": "beta"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_an_unknown_model_is_a_404_naming_the_served_ones_and_a_missing_one_a_400() -> None:
    with routed() as (url, router, loader):
        with pytest.raises(openai.NotFoundError) as missing:
            _complete(url, "gpt-3.5-turbo")
        assert "'gpt-3.5-turbo' is not served here; this server serves 'alpha', 'beta'" in \
            missing.value.body["message"]  # type: ignore[index]
        r = httpx.get(f"{url}/props")
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_missing"
        assert httpx.get(f"{url}/props", params={"model": "beta"}).json()["model_alias"] == "beta"
        tokens = httpx.post(f"{url}/tokenize", json={"content": "ab", "model": "beta"})
        assert tokens.status_code == 200 and tokens.json()["tokens"] == [ord("a") % 16, ord("b") % 16]
        assert loader.events == [("load", "beta")]


def test_an_idle_pair_unloads_after_models_idle_seconds() -> None:
    with routed(budget_mib=None, idle_s=0.3) as (url, router, loader):
        _complete(url, "alpha")
        took = wait_for(lambda: _status(url)["alpha"] == "unloaded", timeout=10)
        assert took >= 0.2
        assert loader.events == [("load", "alpha"), ("unload", "alpha")]


def test_concurrent_clients_swapping_two_pairs_lose_nothing() -> None:
    """Threads ask alpha and beta in turns with room for one: every request answers its pair's own text."""
    expected = {name: _alone(name, "hello", 8) for name in ("alpha", "beta")}
    with routed(budget_mib=1000) as (url, router, loader):
        def ask(i: int) -> tuple[str, str]:
            name = ("alpha", "beta")[i % 2]
            return name, _complete(url, name, "hello", 8)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(ask, range(24)))
        assert all(text == expected[name] for name, text in results)
        assert loader.freed_while_held == []
        assert router.loads >= 2 and router.unloads >= 1


def test_one_pair_answers_load_and_unload_with_501() -> None:
    backend = fake_backend()
    state = ServerState(model_id="fake")
    state.attach(backend)
    try:
        with live_server(create_app(state)) as url:
            r = httpx.post(f"{url}/models/load", json={"model": "fake"})
            assert r.status_code == 501 and "--pair A --pair B" in r.json()["error"]["message"]
    finally:
        backend.worker.shutdown(timeout=30)


# -- safety: no swap for a client that left, nothing freed under a running thread, the shared cache budget --------


def test_a_client_that_gives_up_waiting_for_its_pair_causes_no_swap() -> None:
    """Room for one pair, a long request on alpha, a request for beta whose client times out while it waits:
    alpha is kept (llama-server keeps it), takes requests again at once, and beta is never loaded."""
    with routed(budget_mib=1000, delay=0.05) as (url, router, loader):
        long = ThreadPoolExecutor(1).submit(_complete, url, "alpha", "hello", 150)
        wait_for(lambda: router.pairs["alpha"].leases == 1)
        impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="beta", prompt="hi", max_tokens=4, temperature=0)
        wait_for(lambda: _status(url)["alpha"] == "loaded")  # the drain for beta's room is called off
        assert not long.done()  # (alpha was busy all along)
        assert _complete(url, "alpha", "hi", 4) == _alone("alpha", "hi", 4)  # queued, no reload
        assert long.result(timeout=60) == _alone("alpha", "hello", 150)
        wait_for(lambda: router.pairs["alpha"].leases == 0)
        assert _status(url) == {"alpha": "loaded", "beta": "unloaded"}
        assert loader.events == [("load", "alpha")] and (router.loads, router.unloads) == (1, 0)


def test_a_pair_whose_engine_thread_does_not_end_is_not_freed(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's close of a pair (`_close`): while the engine thread is inside a call (held here) its models
    are not freed, one warning names the pair; once the thread has ended they are."""
    from localspec.server import router as router_module
    from localspec.server import worker as worker_module

    monkeypatch.setattr(worker_module, "STOP_JOIN_S", 0.3)
    backend = fake_backend()
    freed: list[bool] = []  # whether the engine thread was still running when the models were freed

    class Models:
        def close(self) -> None:
            freed.append(backend.worker._thread.is_alive())

    hold = threading.Event()
    busy = backend.worker.in_slot(0, hold.wait)  # the engine thread sits in this call until `hold` is set
    wait_for(lambda: busy.running())
    try:
        router_module._close(backend, Models(), "alpha")  # type: ignore[arg-type]
        assert freed == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "pair 'alpha'" in warnings[0] and "left loaded" in warnings[0], warnings
    finally:
        hold.set()
    wait_for(lambda: not backend.worker._thread.is_alive())
    router_module._close(backend, Models(), "alpha")
    assert freed == [False]


class FailingLoader(FakeLoader):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def load(self, pair: ServedPair) -> Loaded:
        raise self.error


def test_a_load_failure_is_logged_with_its_message_and_clients_see_no_paths(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    from localspec.errors import ModelLoadError

    files = ModelFiles(target=tmp_path / "alpha.gguf", draft=tmp_path / "alpha-draft.gguf", name="alpha")
    pair = ServedPair(name="alpha", files=files, preset=PRESET, footprint=MiB)
    for error, seen in ((RuntimeError("cudaMalloc failed: out of memory"), "RuntimeError"),
                        (ModelLoadError(f"{files.target}: llama.cpp could not load this model"),
                         "alpha.gguf: llama.cpp could not load this model")):
        caplog.clear()
        router = PairRouter([pair], FailingLoader(error))
        with live_server(create_app(ServerState(model_id="alpha", router=router))) as url:
            r = httpx.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
            listed = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert listed["status"] == {"value": "unloaded", "failed": True, "message": seen}
        assert str(tmp_path) not in r.text and str(tmp_path) not in json.dumps(listed)
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert logged == [f"pair 'alpha' failed to load: {'RuntimeError: ' if seen == 'RuntimeError' else ''}{error}"]


def test_models_lists_file_names_never_absolute_paths(tmp_path: Path) -> None:
    files = ModelFiles(target=tmp_path / "big" / "target.gguf", draft=tmp_path / "small" / "draft.gguf", name="a")
    plain = ModelFiles(target=tmp_path / "solo.gguf", draft=None, name="b")
    router = PairRouter([ServedPair(name="a", files=files, preset=PRESET, footprint=MiB),
                         ServedPair(name="b", files=plain, preset=PRESET, footprint=MiB)], FakeLoader())
    with live_server(create_app(ServerState(model_id="a", router=router))) as url:
        r = httpx.get(f"{url}/v1/models")
    listed = {m["id"]: (m["path"], m["draft_path"]) for m in r.json()["data"]}
    assert listed == {"a": ("target.gguf", "draft.gguf"), "b": ("solo.gguf", None)}
    assert str(tmp_path) not in r.text


def test_the_pairs_prompt_caches_share_one_budget_least_recently_used_first() -> None:
    budget = CacheBudget(300)
    alpha, beta = PromptCache(budget=budget), PromptCache(budget=budget)

    def state(tokens: list[int]) -> SlotState:
        return SlotState(tuple(tokens), (ModelState(len(tokens), bytearray(100)),))

    a1, a2, b1 = state([1, 2, 3]), state([4, 5, 6]), state([7, 8, 9])
    assert alpha.put(a1) and alpha.put(a2) and beta.put(b1)
    assert budget.used() == 300 and alpha.best([1, 2, 3, 0]) is not None  # a1 now the most recently used
    assert beta.best([1, 2, 3, 0]) is None  # another pair's states are not its own
    assert beta.put(state([10, 11]))  # the budget's least recently used goes: alpha's a2
    assert alpha.nbytes == 100 and beta.nbytes == 200 and budget.used() == 300
    assert alpha.counters().evicted == 1 and beta.counters().shared_bytes == 300
    beta.clear()  # its pair unloads: its share goes back
    assert budget.used() == 100 and len(alpha) == 1 and alpha.limit == 300


def test_the_prompt_cache_counts_within_models_budget() -> None:
    """One cache budget (200 MiB) for the server: counted in models_budget beside the pairs' estimates."""
    loader = FakeLoader()
    router = PairRouter([_pair("alpha", 600), _pair("beta", 300), _pair("gamma", 900)], loader, budget=1000 * MiB,
                        cache=CacheBudget(200 * MiB))
    loader.router = router
    try:
        with live_server(create_app(ServerState(model_id="alpha", router=router))) as url:
            _complete(url, "alpha")
            _complete(url, "beta")  # 600 + 300 would fit; with the cache's 200 they do not
            assert _status(url) == {"alpha": "unloaded", "beta": "loaded", "gamma": "unloaded"}
            r = httpx.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503
            assert "the prompt cache's 0.20 GiB (cache_ram) is more than models_budget = 1000 MiB" in r.text
    finally:
        router.close()


def test_the_shared_cache_budget_from_cache_ram_and_models_budget() -> None:
    from localspec.errors import LocalspecError
    from localspec.rounds.prompt_cache import AUTO_SHARE

    def settings(**kw: str) -> ServerSettings:
        return dataclasses.replace(PRESET.server, **kw)

    assert shared_cache(settings(cache_ram="64", models_budget="1000")).limit == 64 * MiB
    auto = shared_cache(settings(cache_ram="auto", models_budget="1000")).limit
    assert 0 < auto <= int(1000 * MiB * AUTO_SHARE)
    assert shared_cache(settings(cache_ram="0", models_budget="1000")).limit == 0
    with pytest.raises(LocalspecError, match="cache_ram = 1000 MiB is all of models_budget = 1000 MiB"):
        shared_cache(settings(cache_ram="1000", models_budget="1000"))


# -- --draft auto: models.toml's drafts, by family and the tokenizer check ---------------------------------------

USER_PAIRS = """
[[pair]]
name = "tiny"
description = "the tiny pair"
n_ctx = 512
n_draft = 4
[pair.target]
repo = "org/tiny-target"
file = "target.gguf"
quant = "F32"
family = "tiny"
license = "mit"
[pair.draft]
repo = "org/tiny-draft"
file = "draft.gguf"
quant = "F32"
family = "tiny"
license = "mit"

[[pair]]
name = "tiny-other-tokenizer"
description = "a draft of the same family with another tokenizer model: the check refuses it"
n_ctx = 512
n_draft = 4
[pair.target]
repo = "org/elsewhere"
file = "elsewhere.gguf"
quant = "F32"
family = "tiny"
license = "mit"
[pair.draft]
repo = "org/bad-draft"
file = "bad-draft.gguf"
quant = "F32"
family = "tiny"
license = "mit"

[[pair]]
name = "big-family"
description = "another family, not downloaded"
n_ctx = 512
n_draft = 4
[pair.target]
repo = "org/big"
file = "big.gguf"
quant = "Q4_K_M"
family = "big"
license = "mit"
[pair.draft]
repo = "org/big-draft"
file = "big-draft.gguf"
quant = "Q8_0"
family = "big"
license = "mit"
"""


@pytest.fixture
def auto_home(tiny_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    from tests import helpers_gguf as G

    home, hub = tmp_path / "home", tmp_path / "hub"
    home.mkdir()
    (home / "models.toml").write_text(USER_PAIRS)
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    target, draft = tiny_pair
    bad = G.rewrite(draft, tmp_path / "bad-draft.gguf", {"tokenizer.ggml.model":
                                                        G.kv("tokenizer.ggml.model", G.STRING, "llama")})
    return {"target": cache_file(hub, "org/tiny-target", "target.gguf", target.read_bytes()),
            "draft": cache_file(hub, "org/tiny-draft", "draft.gguf", draft.read_bytes()),
            "bad": cache_file(hub, "org/bad-draft", "bad-draft.gguf", bad.read_bytes()), "hub": hub, "home": home}


def test_draft_auto_picks_the_family_draft_that_passes_the_tokenizer_check(auto_home: dict[str, Path]) -> None:
    from localspec.cli.options import RunOptions

    files = RunOptions(target=auto_home["target"], draft=["auto"]).files()
    assert files.draft == auto_home["draft"] and files.target == auto_home["target"]
    # A target models.toml does not list: the architecture in both headers is its family; the same answer.
    elsewhere = auto_home["home"] / "my-own-target.gguf"
    elsewhere.write_bytes(auto_home["target"].read_bytes())
    assert RunOptions(target=elsewhere, draft=["auto", "4"]).files().draft == auto_home["draft"]


def test_draft_auto_without_a_match_is_one_line_exit_2_naming_what_was_tried(auto_home: dict[str, Path]) -> None:
    import os
    import subprocess
    import sys

    for folder in auto_home["hub"].glob("models--org--tiny-draft"):
        import shutil

        shutil.rmtree(folder)  # the good draft is not downloaded: only the one with another tokenizer is left
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("LOCALSPEC_DEBUG", None)
    run = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "serve", "--port", "0",
                          "--target", str(auto_home["target"]), "--draft", "auto"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "--draft auto: no downloaded draft in models.toml fits target.gguf (family tiny)" in lines[0]
    assert "draft.gguf (not downloaded)" in lines[0] and "bad-draft.gguf (tokenizer:" in lines[0]
    assert "big-draft" not in lines[0]  # another family is not even mentioned
