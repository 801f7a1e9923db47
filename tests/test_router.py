"""`localspec serve --pair demo --pair demo-chat`: two real pairs behind one endpoint, driven by the official
`openai` client, against each pair served alone (`serve --pair NAME`, the one-pair server). The routing and
swapping logic itself is covered fast over fake pairs in tests/test_router_fast.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from localspec.cli import options
from localspec.cli.serve_cmd import model_id
from localspec.server.router import served_pair
from tests.test_serve import Server

pytestmark = pytest.mark.slow

PAIRS = ("demo", "demo-chat")
COMMON = ("--threads", "1", "--ctx", "512", "--temp", "0")
PROMPTS = {"demo": "The three primary colours are", "demo-chat": "Once upon a time"}
N = 16


def _footprints() -> dict[str, int]:
    """Each pair's estimate in MiB at these settings (the one the router counts against the budget)."""
    out = {}
    for name in PAIRS:
        files, preset = options.resolve_run(options.RunOptions(pair=name, n_ctx=512, threads=1), "server")
        out[name] = served_pair(files, preset, model_id(files), 1).footprint >> 20
    return out


def _text(server: Server, name: str, n: int = N) -> str:
    r = server.client().completions.create(model=name, prompt=PROMPTS[name], max_tokens=n, temperature=0)
    assert r.model == name
    return r.choices[0].text


def _status(server: Server) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{server.url}/models", timeout=10).json()["data"]}


@pytest.fixture(scope="module")
def alone(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What each pair answers served alone: the one-pair server as before."""
    out = {}
    for name in PAIRS:
        server = Server(demo_home, tmp_path_factory.mktemp(name), "--pair", name, *COMMON)
        try:
            out[name] = _text(server, name)
            out[name + "-long"] = _text(server, name, 96)
        finally:
            server.stop()
    return out


CACHE_MIB = 16  # the prompt cache's budget, shared by the pairs and counted within --models-budget


@pytest.fixture
def one_at_a_time(use_demo_home: Path, tmp_path: Path) -> Iterator[Server]:
    """Both pairs, with a budget that holds either (and the prompt cache) but not both."""
    sizes = _footprints()
    budget = max(sizes.values()) + min(sizes.values()) // 2 + CACHE_MIB
    server = Server(use_demo_home, tmp_path, "--pair", "demo", "--pair", "demo-chat", *COMMON,
                    "--models-budget", str(budget), "--cache-ram", str(CACHE_MIB))
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log.read_text()


def test_two_pairs_answer_as_each_alone_and_swap_within_the_budget(one_at_a_time: Server,
                                                                   alone: dict[str, str]) -> None:
    server = one_at_a_time
    listed = httpx.get(f"{server.url}/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == list(PAIRS)
    assert _status(server) == {"demo": "unloaded", "demo-chat": "unloaded"}
    assert _text(server, "demo") == alone["demo"]
    assert _status(server) == {"demo": "loaded", "demo-chat": "unloaded"}
    assert _text(server, "demo-chat") == alone["demo-chat"]  # demo out, demo-chat in
    assert _status(server) == {"demo": "unloaded", "demo-chat": "loaded"}
    assert _text(server, "demo") == alone["demo"]  # and back
    health = server.health()
    assert (health["loads"], health["unloads"]) == (3, 2)

    with pytest.raises(openai.NotFoundError) as unknown:
        _text_of(server, "gpt-4o")
    assert "this server serves 'demo', 'demo-chat'" in unknown.value.body["message"]  # type: ignore[index]

    # Concurrent clients on both pairs, room for one: every request waits its turn, none fails, none differs.
    with ThreadPoolExecutor(4) as pool:
        names = [PAIRS[i % 2] for i in range(8)]
        texts = list(pool.map(lambda name: (name, _text(server, name)), names))
    assert [(name, alone[name]) for name in names] == texts
    assert server.health()["unloads"] >= 3


def _text_of(server: Server, model: str) -> str:
    r = server.client().completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    return r.choices[0].text


def test_unloading_a_busy_pair_waits_for_its_stream_to_end(one_at_a_time: Server, alone: dict[str, str]) -> None:
    server = one_at_a_time
    stream = iter(server.client().completions.create(model="demo", prompt=PROMPTS["demo"], max_tokens=96,
                                                     temperature=0, stream=True))
    first = next(stream).choices[0].text
    r = httpx.post(f"{server.root}/models/unload", json={"model": "demo"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"success": True, "deferred": True, "requests": 1}
    assert _status(server)["demo"] == "unloading"
    text = first + "".join(c.choices[0].text for c in stream)
    assert text == alone["demo-long"]
    deadline = time.monotonic() + 60
    while _status(server)["demo"] != "unloaded":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    loaded = httpx.post(f"{server.root}/models/load", json={"model": "demo-chat"}, timeout=300)
    assert loaded.json() == {"success": True} and _status(server)["demo-chat"] == "loaded"


def test_a_budget_no_pair_fits_is_a_503_and_the_server_stays_up(use_demo_home: Path, tmp_path: Path) -> None:
    server = Server(use_demo_home, tmp_path, "--pair", "demo", "--pair", "demo-chat", *COMMON,
                    "--models-budget", "64")
    try:
        for name in PAIRS:
            with pytest.raises(openai.APIStatusError) as failed:
                _text(server, name)
            assert failed.value.status_code == 503
            assert f"pair {name!r} cannot be loaded" in failed.value.body["message"]  # type: ignore[index]
            assert "models_budget = 64 MiB" in failed.value.body["message"]  # type: ignore[index]
        assert server.health()["status"] == "ok" and _status(server) == {"demo": "unloaded", "demo-chat": "unloaded"}
    finally:
        server.stop()


def test_a_client_that_gives_up_waiting_for_the_other_pair_causes_no_swap(one_at_a_time: Server) -> None:
    """Room for one pair, demo busy streaming, a request for demo-chat whose client times out while it waits:
    demo stays loaded (as llama-server keeps it), demo-chat is never loaded."""
    server = one_at_a_time
    stream = iter(server.client().completions.create(model="demo", prompt=PROMPTS["demo"], max_tokens=400,
                                                     temperature=0, stream=True))
    next(stream)
    with pytest.raises(openai.APITimeoutError):
        server.client().with_options(timeout=0.5).completions.create(model="demo-chat", prompt="hi", max_tokens=2)
    deadline = time.monotonic() + 30
    while _status(server)["demo"] != "loaded":  # the drain begun for demo-chat's room is called off
        assert time.monotonic() < deadline, _status(server)
        time.sleep(0.05)
    assert server.health()["models"][0]["requests"] == 1  # (the stream was running all along)
    for _ in stream:
        pass
    health = server.wait_idle()
    assert _status(server) == {"demo": "loaded", "demo-chat": "unloaded"}
    assert (health["loads"], health["unloads"]) == (1, 0)


def test_a_pair_whose_engine_thread_is_busy_is_not_freed(use_demo_home: Path, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The real loader's close while the engine thread is inside a call (held here): the models are left (one
    warning names the pair), and freed once the thread has ended."""
    from localspec.server import worker
    from localspec.server.router import SessionLoader

    monkeypatch.setattr(worker, "STOP_JOIN_S", 0.5)
    files, preset = options.resolve_run(options.RunOptions(pair="demo", n_ctx=512, threads=1), "server")
    loaded = SessionLoader(parallel=1, queue=4).load(served_pair(files, preset, "demo", 1))
    backend = loaded.backend
    target, draft = backend.worker.engine.target, backend.worker.engine.draft
    hold = threading.Event()
    busy = backend.worker.in_slot(0, hold.wait)
    deadline = time.monotonic() + 30
    while not busy.running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        loaded.close()
        assert target.ctx is not None and target.model is not None  # type: ignore[attr-defined]
        assert draft is not None and draft.ctx is not None  # type: ignore[attr-defined]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "pair 'demo'" in warnings[0], warnings
    finally:
        hold.set()
    backend.worker._thread.join(timeout=30)
    loaded.close()
    assert target.ctx is None and draft.ctx is None  # type: ignore[attr-defined]


def test_the_pairs_share_one_prompt_cache_budget_shown_in_metrics(use_demo_home: Path, tmp_path: Path) -> None:
    server = Server(use_demo_home, tmp_path, "--pair", "demo", "--pair", "demo-chat", *COMMON, "--metrics",
                    "--cache-ram", "64")
    try:
        for name in PAIRS:  # the slot goes to a second prompt: the first one's cells go to the cache
            _text(server, name, 4)
            server.client().completions.create(model=name, prompt="A different start", max_tokens=4)
        values = {name: _metrics(server, name) for name in PAIRS}
        held = [values[name]["localspec:prompt_cache_bytes"] for name in PAIRS]
        assert all(h > 0 for h in held)
        for name in PAIRS:
            assert values[name]["localspec:prompt_cache_limit_bytes"] == 64 << 20
            assert values[name]["localspec:prompt_cache_shared_bytes"] == sum(held)
    finally:
        assert server.stop() == 0, server.log.read_text()


def test_a_prompt_cache_that_leaves_the_budget_no_room_is_one_line_before_the_port(use_demo_home: Path,
                                                                                  tmp_path: Path) -> None:
    env = {**os.environ, "LOCALSPEC_HOME": str(use_demo_home), "COLUMNS": "200"}
    env.pop("LOCALSPEC_DEBUG", None)
    run = subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "serve", "--port", "0",
                          "--pair", "demo", "--pair", "demo-chat", "--models-budget", "512", "--cache-ram", "512"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "cache_ram = 512 MiB is all of models_budget = 512 MiB" in lines[0], run.stderr


def _metrics(server: Server, name: str) -> dict[str, float]:
    text = httpx.get(f"{server.root}/metrics", params={"model": name}, timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}
