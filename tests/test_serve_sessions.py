"""Long sessions on a live `localspec serve` (the demo-chat pair, two slots): llama-server's slot actions with
`--slot-save-path` in its shapes (save, erase, restore into another slot and go on as if never interrupted), file
names that try to leave the save folder, damaged and foreign files (a 400, the slot as it was), a restore into a
busy slot (it waits for the generation), the prompt cache's hits in /metrics and the reply's `cache_n`, and
context shift asked per request. Replies are compared with the same request on a cold slot (temperature 0).

Every wait is bounded in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_serve import Server

pytestmark = pytest.mark.slow

PROMPT = "The history of the Roman empire begins with the founding of the city, which"
OTHER = "A recipe for bread: mix flour, water, salt and yeast, then"


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slot-saves")


@pytest.fixture(scope="module")
def server(demo_home, tmp_path_factory, saves: Path) -> Iterator[Server]:
    s = Server(demo_home, tmp_path_factory.mktemp("serve-sessions"), "--pair", "demo-chat", "--parallel", "2",
               "--ctx", "256", "--threads", "1", "--metrics", "--slot-save-path", str(saves), "--cache-ram", "64")
    yield s
    s.stop()


def post(server: Server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.root}{path}", json=body if body is not None else {}, timeout=600, **kw)


def complete(server: Server, prompt: str, slot: int, n: int = 16, **more) -> dict:
    r = post(server, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": slot, **more})
    assert r.status_code == 200, r.text
    return r.json()


def erase_all(server: Server) -> None:
    for slot in (0, 1):
        assert post(server, f"/slots/{slot}?action=erase").status_code == 200


def test_save_erase_restore_into_another_slot_and_go_on(server: Server, saves: Path) -> None:
    server.wait_idle()
    erase_all(server)
    first = complete(server, PROMPT, 0)
    saved = post(server, "/slots/0?action=save", {"filename": "roman.bin"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert set(body) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert body["id_slot"] == 0 and body["filename"] == "roman.bin" and set(body["timings"]) == {"save_ms"}
    assert body["n_saved"] == first["tokens_evaluated"] + first["tokens_predicted"] - 1
    assert body["n_written"] == (saves / "roman.bin").stat().st_size
    erased = post(server, "/slots/0?action=erase").json()
    assert erased == {"id_slot": 0, "n_erased": body["n_saved"]}
    restored = post(server, "/slots/1?action=restore", {"filename": "roman.bin"})
    assert restored.status_code == 200, restored.text
    rb = restored.json()
    assert set(rb) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert rb["n_restored"] == body["n_saved"] and rb["n_read"] == body["n_written"]
    assert get_slots(server)[1]["n_tokens"] == body["n_saved"]
    follow = PROMPT + first["content"] + " Later,"
    resumed = complete(server, follow, 1)
    # Nothing of the saved part is read again (but where the text's tokens at the reply's end re-tokenize apart)
    assert resumed["timings"]["cache_n"] >= body["n_saved"] - 2
    erase_all(server)
    cold = complete(server, follow, 0)
    assert cold["timings"]["cache_n"] == 0 and resumed["content"] == cold["content"]


def get_slots(server: Server) -> list[dict]:
    return httpx.get(f"{server.root}/slots", timeout=30).json()


@pytest.mark.parametrize("name", ["../escape.bin", "a/b.bin", "..", ".", "", "/tmp/abs.bin", "x\\y", "bad:name",
                                  "trail.", " lead"])
def test_a_file_name_that_is_not_one_name_in_the_folder_is_a_400(server: Server, saves: Path, name: str) -> None:
    for action in ("save", "restore"):
        r = post(server, f"/slots/0?action={action}", {"filename": name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
        assert "Invalid filename" in r.json()["error"]["message"]
    assert not (saves.parent / "escape.bin").exists() and not Path("/tmp/abs.bin").exists()


def test_bad_requests_are_400s_naming_the_field(server: Server) -> None:
    cases = [("/slots/2?action=save", {"filename": "x"}, "id_slot"), ("/slots/-1?action=save", {"filename": "x"},
             "id_slot"), ("/slots/zero?action=erase", {}, "id_slot"), ("/slots/0?action=copy", {}, "action"),
             ("/slots/0", {}, "action"), ("/slots/0?action=save", {}, "filename"),
             ("/slots/0?action=save", {"filename": 3}, "filename"),
             ("/slots/0?action=save", {"filename": "x", "extra": 1}, "extra")]
    for path, body, param in cases:
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_a_damaged_or_foreign_file_is_a_400_and_the_slot_is_kept(server: Server, saves: Path) -> None:
    server.wait_idle()
    done = complete(server, OTHER, 0)
    held = get_slots(server)[0]["n_tokens"]
    assert post(server, "/slots/0?action=save", {"filename": "bread.bin"}).status_code == 200
    raw = (saves / "bread.bin").read_bytes()
    damaged = bytearray(raw)
    damaged[len(raw) // 2] ^= 0xFF
    (saves / "damaged.bin").write_bytes(bytes(damaged))
    (saves / "short.bin").write_bytes(raw[:-100])
    (saves / "llama.bin").write_bytes(b"ggsq" + raw[4:200])  # not localspec's format
    header = raw.index(b'"fingerprint":"') + len(b'"fingerprint":"')
    foreign = bytearray(raw)
    foreign[header] = ord("0") if raw[header] != ord("0") else ord("1")  # another model's
    (saves / "foreign.bin").write_bytes(bytes(foreign))
    for name, why in (("damaged.bin", "checksum mismatch"), ("short.bin", "cut short"),
                      ("llama.bin", "not a localspec slot file"), ("foreign.bin", "saved with the target"),
                      ("missing.bin", "no such slot file")):
        r = post(server, "/slots/0?action=restore", {"filename": name})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert why in message and str(saves) not in message, message
    assert get_slots(server)[0]["n_tokens"] == held
    again = complete(server, OTHER, 0)
    assert again["content"] == done["content"] and again["timings"]["cache_n"] == done["tokens_evaluated"] - 1


def test_a_restore_into_a_busy_slot_waits_for_its_generation(server: Server) -> None:
    server.wait_idle()
    complete(server, PROMPT, 1)
    assert post(server, "/slots/1?action=save", {"filename": "busy.bin"}).status_code == 200
    ended: dict[str, float] = {}
    result: dict[str, dict] = {}

    def long_generation() -> None:
        result["reply"] = complete(server, OTHER, 0, n=120)
        ended["generation"] = time.monotonic()

    worker = threading.Thread(target=long_generation)
    worker.start()
    deadline = time.monotonic() + 120
    while not get_slots(server)[0]["is_processing"]:
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.05)
    r = post(server, "/slots/0?action=restore", {"filename": "busy.bin"})
    ended["restore"] = time.monotonic()
    worker.join(timeout=600)
    assert r.status_code == 200 and result["reply"]["tokens_predicted"] == 120
    assert ended["restore"] >= ended["generation"] - 0.5  # answered once the generation was over
    follow = complete(server, PROMPT, 0)
    assert follow["timings"]["cache_n"] == follow["tokens_evaluated"] - 1  # slot 0 holds what was restored


def metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.root}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_two_conversations_on_one_slot_hit_the_prompt_cache(server: Server) -> None:
    """Conversations pinned to one slot in turn: each comes back from host RAM (cache_n = what it held), the
    replies are a cold slot's, and /metrics counts the hits and the bytes held."""
    server.wait_idle()
    erase_all(server)
    before = metrics(server)
    first, other = "In the year 1888 a ship left the harbour of", "The rules of chess say that a pawn"  # uncached
    a1 = complete(server, first, 0)
    complete(server, other, 0)  # slot 0 goes to another conversation: the first one's cells go to the cache
    follow = first + a1["content"] + " Then"
    a2 = complete(server, follow, 0)
    assert a2["timings"]["cache_n"] >= a1["tokens_evaluated"] + a1["tokens_predicted"] - 3
    after = metrics(server)
    assert after["localspec:prompt_cache_hits_total"] == before["localspec:prompt_cache_hits_total"] + 1
    assert after["localspec:prompt_cache_misses_total"] == before["localspec:prompt_cache_misses_total"] + 2
    assert after["localspec:prompt_cache_bytes"] > 0 and after["localspec:prompt_cache_entries"] >= 1
    assert after["localspec:prompt_cache_limit_bytes"] == 64 << 20
    erase_all(server)
    cold = complete(server, follow, 1)
    assert cold["content"] == a2["content"]


def test_context_shift_per_request(server: Server) -> None:
    """A reply longer than the context (256) with context_shift: it goes on, `truncated` says it shifted, and
    asked twice it is the same (the shift is part of greedy decoding, not noise)."""
    server.wait_idle()
    body = {"prompt": "Counting from one: 1, 2, 3, 4,", "n_predict": 320, "temperature": 0, "repeat_penalty": 1.0,
            "context_shift": True, "n_keep": -1}
    one = post(server, "/completion", body).json()
    assert one["truncated"] is True and one["tokens_evaluated"] + one["tokens_predicted"] > 256
    assert one["tokens_predicted"] == 320 or one["stop_type"] == "eos"
    assert one["generation_settings"]["n_keep"] == -1
    erase_all(server)
    two = post(server, "/completion", body).json()
    assert two["content"] == one["content"]
    plain = post(server, "/completion", {**body, "context_shift": False}).json()
    assert plain["truncated"] is False and plain["tokens_predicted"] < 256 and plain["stop_type"] == "limit"


@pytest.fixture(scope="module")
def bare(demo_home, tmp_path_factory) -> Iterator[Server]:
    """No --slot-save-path, no prompt cache (--cache-ram 0)."""
    s = Server(demo_home, tmp_path_factory.mktemp("serve-bare"), "--pair", "demo-chat", "--ctx", "256",
               "--threads", "1", "--metrics", "--cache-ram", "0")
    yield s
    s.stop()


def test_slot_actions_need_a_save_path_and_the_cache_can_be_off(bare: Server) -> None:
    r = post(bare, "/slots/0?action=save", {"filename": "x.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    assert post(bare, "/slots/0?action=erase").status_code == 501
    values = metrics(bare)
    assert values["localspec:prompt_cache_limit_bytes"] == 0 and values["localspec:prompt_cache_hits_total"] == 0
