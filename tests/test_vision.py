"""Pictures in prompts (llama.vision): a synthetic projector (bench/synthetic.py's `gemma3`-type mmproj) beside the
tiny synthetic pairs, through the real libmtmd. Greedy output with a picture and speculation equals plain decoding
with it, and equals libmtmd's own helper path in a context of its own (a reference that shares none of localspec's
code); a picture reaches the model; hostile pictures and files are one line each, before any model loads."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mtmd  # (the README's build has libmtmd: no skip where it lacks)

from localspec.config import Preset, load_preset
from localspec.errors import ModelLoadError, UsageError
from localspec.llama import vision
from localspec.llama.vision import ImageError, Picture, decode_picture, placeholder_ids
from localspec.rounds.events import collect
from localspec.rounds.prompt_cache import picture_boundary, shared_prefix
from localspec.rounds.slot_cells import batch_cut
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_rounds import run_together

GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)
LIMITS = GREEDY.images


def png(width: int, height: int, seed: int = 1, *, crc: bool = True, body: bytes | None = None) -> bytes:
    """A PNG written by hand (8-bit RGB, one IDAT): random pixels, or `body` as the compressed data."""
    r = random.Random(seed)

    def chunk(kind: bytes, data: bytes) -> bytes:
        check = zlib.crc32(kind + data) if crc else 0
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", check)

    if body is None:
        raw = b"".join(b"\0" + bytes(r.randrange(256) for _ in range(3 * width)) for _ in range(height))
        body = zlib.compress(raw)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def projector(tmp_path_factory, tiny_pair_high) -> Path:
    from synthetic import TINY_HIGH, ProjectorSpec, write_projector

    return write_projector(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf",
                           ProjectorSpec(n_embd_text=TINY_HIGH.n_embd, projection_std=1.0))


def files(pair, mmproj: Path | None) -> ModelFiles:
    return ModelFiles(target=pair[0], draft=pair[1], name="test", mmproj=mmproj)


def picture(seed: int, width: int = 40, height: int = 24) -> Picture:
    return decode_picture(png(width, height, seed), f"picture {seed}", LIMITS)


def prompt(session, text: str, pictures: list[Picture]) -> list[int]:
    return session.target.projector.tokenize(vision.with_markers(text, len(pictures)), pictures,
                                             add_special=True, parse_special=False)


def request(tokens: list[int], n_draft: int, drafter: str = "model", max_tokens: int = 24) -> dict:
    drafting = dataclasses.replace(GREEDY.draft, n_draft=n_draft, drafter=drafter, p_min=0.0, adaptive=False)
    return dict(prompt=tokens, sampling=GREEDY.sampling, drafting=drafting, max_tokens=max_tokens)


# -- pictures in, checked before anything decodes them --------------------------------------------------------------


def test_a_picture_decodes_to_its_pixels_and_a_digest_of_them():
    a, b = picture(1), picture(2)
    assert (a.width, a.height, len(a.rgb)) == (40, 24, 40 * 24 * 3)
    assert a.digest != b.digest and picture(1).digest == a.digest
    ids = placeholder_ids(a.digest, 16)
    assert all(-(2**31) <= t < 0 for t in ids) and len(set(ids)) == 16  # int32, negative, distinct
    assert placeholder_ids(b.digest, 16) != ids


@pytest.mark.parametrize(("data", "why"), [
    (b"", "empty"),
    (b"hello, this is text and no picture", "not a picture localspec reads"),
    (png(40, 24)[:60], "truncated or corrupt"),  # cut inside the pixels
    (png(40, 24, crc=False), "not a picture localspec reads"),  # checksums that do not match
    (png(20_000, 20_000, body=zlib.compress(b"\0" * 1000)), "declares too many pixels"),  # a bomb
    (png(8000, 6000, body=zlib.compress(b"\0" * 1000)), "8000 x 6000 pixels; .*max_image_pixels"),
    (png(9000, 10, body=zlib.compress(b"\0" * 100)), "9000 x 10 pixels"),  # one side too long
    (b"\x00\x00\x00\x18ftypmp42" + b"\0" * 64, "not a picture"),  # a video's header: never handed to ffmpeg
])
def test_a_bad_picture_is_one_line_naming_it(data, why):
    with pytest.raises(ImageError, match=why) as caught:
        decode_picture(data, "part 2", LIMITS)
    assert str(caught.value).startswith("part 2: ") and "\n" not in str(caught.value)


def test_a_picture_over_the_byte_limit_is_refused_unread(tmp_path):
    big = tmp_path / "big.png"
    with big.open("wb") as f:
        f.truncate(LIMITS.max_image_bytes + 1)  # sparse: nothing is written, and nothing may be read
    with pytest.raises(ImageError, match=r"big\.png: 20,000,001 bytes; .*max_image_bytes"):
        vision.read_picture(big, LIMITS)
    with pytest.raises(ImageError, match="No such file"):
        vision.read_picture(tmp_path / "missing.png", LIMITS)


def test_a_kept_prefix_never_ends_inside_a_picture():
    tokens = [5, 6, -1, -2, -3, 7, -4, -5, 8]
    assert [picture_boundary(tokens, n) for n in range(10)] == [0, 1, 2, 2, 2, 5, 6, 6, 8, 9]
    assert shared_prefix([5, 6, -1, -2, 99], tokens) == 2  # a slot holding half of the picture keeps none of it
    assert shared_prefix([5, 6, -1, -2, -3, 7], tokens) == 6
    assert batch_cut(tokens, 4) == 2 and batch_cut(tokens[2:], 2) == 3  # a batch takes a picture whole
    assert vision.text_prefix([3, 4, -9, 5]) == [3, 4]


# -- the projector file ------------------------------------------------------------------------------------------


def test_a_file_that_is_no_projector_is_one_line_before_any_load(tiny_pair_high, tmp_path):
    with pytest.raises(ModelLoadError, match="not a projector .*'clip'"):
        vision.check_projector_file(tiny_pair_high[0])
    with pytest.raises(ModelLoadError, match="projector file not found"):
        open_session(files(tiny_pair_high, tmp_path / "nope.gguf"), GREEDY)


def test_a_projector_of_another_width_is_refused(tiny_pair_high, tmp_path):
    from synthetic import ProjectorSpec, write_projector

    other = write_projector(tmp_path / "wide.gguf", ProjectorSpec(n_embd_text=576))
    with pytest.raises(ModelLoadError, match="could not load this projector .*embedding width"):
        open_session(files(tiny_pair_high, other), GREEDY)


# -- generation with pictures --------------------------------------------------------------------------------------


def reference_greedy(target: Path, mmproj: Path, text: str, pictures: list[Picture], n: int,
                     with_row: bool = False, n_batch: int = 512) -> Any:
    """Greedy tokens after the prompt through libmtmd's own helper (`mtmd_helper_eval_chunks`: its tokenizer, its
    chunk evaluation, its positions) and single-token llama_decode calls, in a context of its own: no localspec code
    on the path. `with_row`: (the tokens, the logits after the prompt). `n_batch`: the context's batch, and libmtmd's
    for the prompt's chunks (a picture of more tokens is decoded that many at a time)."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False  # (as localspec loads it: one token and a batch score alike on the CPU)
    model = llama_cpp.llama_model_load_from_file(str(target).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_threads, cparams.n_threads_batch = (
        1024, n_batch, n_batch, 1, 1)
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    mp = mtmd.mtmd_context_params_default()
    # warmed up, as llama-server (and localspec) load it: flash attention in the tower where the backend runs it
    mp.use_gpu, mp.n_threads, mp.warmup, mp.print_timings = False, 1, True, False
    mctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, mp)
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = [mtmd.mtmd_bitmap_init(p.width, p.height, (ctypes.c_uint8 * len(p.rgb)).from_buffer_copy(p.rgb))
               for p in pictures]
    entry = mtmd.mtmd_input_text()
    encoded = vision.with_markers(text, len(pictures)).encode()
    entry.text, entry.text_len, entry.add_special, entry.parse_special = encoded, len(encoded), True, False
    assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(entry),
                              (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps), len(bitmaps)) == 0
    n_past = ctypes.c_int(0)
    assert mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, n_batch, True, ctypes.byref(n_past)) == 0
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    out: list[int] = []
    first_row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    try:
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1, token, n_past.value, 1
            batch.seq_id[0][0], batch.logits[0] = 0, True
            assert llama_cpp.llama_decode(ctx, batch) == 0
            n_past.value += 1
    finally:
        llama_cpp.llama_batch_free(batch)
        for b in bitmaps:
            mtmd.mtmd_bitmap_free(b)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_free(mctx)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return (out, first_row) if with_row else out


def test_greedy_with_a_picture_is_plain_decoding_with_it_for_every_drafter(tiny_pair_high, projector):
    """The same picture and text: plain decoding, the draft model, prompt lookup and the chain emit the same tokens
    as libmtmd's helper path alone; another picture gives other tokens (the picture reaches the model)."""
    text = "Describe the picture in a few words, then the picture again:"
    pictures = [picture(1)]
    expected = reference_greedy(tiny_pair_high[0], projector, text, pictures, 24)
    with open_session(files(tiny_pair_high, projector), GREEDY) as s:
        tokens = prompt(s, text, pictures)
        assert sum(t < 0 for t in tokens) == 16 and tokens[-1] >= 0
        runs = {}
        for name, k in (("plain", 0), ("model", 4), ("lookup", 4), ("chain", 4)):
            s.engine.reset()
            runs[name] = collect(s.engine.generate(**request(tokens, k, "model" if name == "plain" else name)))
        assert all(r.tokens == expected for r in runs.values()), {n: r.tokens for n, r in runs.items()}
        assert runs["model"].done.stats.drafted > 0 and runs["model"].done.stats.accepted > 0

        def last_row(tokens: list[int]) -> np.ndarray:
            s.engine.reset()
            s.target.use_device_sampler(None, 0)  # full logits
            scores = s.target.decode(tokens, 0, seq=0)
            assert scores is not None and scores.logits is not None
            return scores.logits[-1].copy()

        # (the tiny synthetic model's next token hardly depends on anything but the last few: the logits of a row a
        # few tokens after the picture)
        near = last_row(prompt(s, "Now:", [picture(1)]))
        assert np.abs(near - last_row(prompt(s, "Now:", [picture(2)]))).max() > 1e-3
        np.testing.assert_array_equal(near, last_row(prompt(s, "Now:", [picture(1)])))


def test_a_slot_keeps_a_picture_it_holds_and_drops_one_it_does_not(tiny_pair_high, projector):
    """The next request with the same picture reuses the slot's cells past it; with another picture at the same
    place the cells are cut before it (never inside), and the output is what a fresh slot gives."""
    text = "What is in it?"
    with open_session(files(tiny_pair_high, projector), GREEDY) as s:
        first = prompt(s, text, [picture(1)])
        collect(s.engine.generate(**request(first, 4)))
        again = collect(s.engine.generate(**request(first + [first[-1]], 4)))
        assert again.done.stats.prompt_tokens_processed <= 2  # the picture and text were kept
        swapped = prompt(s, text, [picture(3)])
        reused = collect(s.engine.generate(**request(swapped, 4)))
        start = next(i for i, t in enumerate(swapped) if t < 0)
        assert reused.done.stats.prompt_tokens_processed == len(swapped) - 1 - start
        s.engine.reset()
        assert collect(s.engine.generate(**request(swapped, 4))).tokens == reused.tokens


def slots_match_alone(pair, mmproj: Path, asked: list[tuple[str, list[Picture], int, str]],
                      preset: Preset = GREEDY) -> None:
    """Requests (text, pictures, draft length, drafter) arriving at different rounds in a 3-slot engine get what each
    gets alone in an engine of one slot."""

    def requests(s) -> list[dict]:  # (each session's projector reads its own prompts' pictures)
        return [request(prompt(s, text, pics), k, drafter) for text, pics, k, drafter in asked]

    with open_session(files(pair, mmproj), preset, parallel=3) as s:
        together = run_together(s.engine, requests(s), arrivals=[0, 2, 1])
    with open_session(files(pair, mmproj), preset) as alone:
        for r, got in zip(requests(alone), together, strict=True):
            alone.engine.reset()
            assert collect(alone.engine.generate(**r)).tokens == got


def test_slots_with_pictures_each_get_what_they_get_alone(tiny_pair_high, projector):
    """Three requests with different pictures (one with two), arriving at different rounds in a 3-slot engine."""
    slots_match_alone(tiny_pair_high, projector, [
        ("One:", [picture(1)], 4, "model"), ("Two pictures, compare them:", [picture(2), picture(4)], 3, "lookup"),
        ("Three, in a sentence:", [picture(5)], 0, "model")])


def test_what_a_prompt_with_pictures_cannot_do_is_one_line(tiny_pair_high, projector):
    with open_session(files(tiny_pair_high, projector), GREEDY) as s:
        tokens = prompt(s, "x", [picture(1)])
        with pytest.raises(UsageError, match="ends with a picture"):
            s.engine.generate(**request(tokens[: tokens.index(next(t for t in tokens if t < 0)) + 16], 4)).__next__()
        shifted = GREEDY.with_overrides(context_shift=True).context
        with pytest.raises(UsageError, match="context shift cannot drop part of a picture"):
            next(s.engine.generate(**request(tokens, 4), context=shifted))
        with pytest.raises(ImageError, match="2 picture markers .* for 1 pictures"):
            s.target.projector.tokenize("<__media__> <__media__>", [picture(1)], add_special=True,
                                        parse_special=False)
    no_projector = r"no projector \(mmproj\) is loaded for the target \(--mmproj PATH\)"
    with open_session(files(tiny_pair_high, None), GREEDY) as plain, pytest.raises(UsageError, match=no_projector):
        next(plain.engine.generate(**request(tokens, 4)))
    # Gemma 3's pictures attend to themselves both ways: one needs a batch of its own (16 tokens here), where a
    # Qwen-VL picture is read a batch at a time (test_vision_mrope)
    with open_session(files(tiny_pair_high, projector), GREEDY.with_overrides(n_batch=8)) as small, \
            pytest.raises(ImageError, match=r"a picture of 16 tokens does not fit one batch of 8 \(\[load\] n_batch\)"):
        prompt(small, "x", [picture(1)])


# -- the command line ------------------------------------------------------------------------------------------------


def localspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_with_an_image_prints_what_the_engine_decodes(tiny_pair_high, projector, tmp_path):
    (tmp_path / "a.png").write_bytes(png(40, 24, 1))
    common = ["generate", "--target", str(tiny_pair_high[0]), "--draft", str(tiny_pair_high[1]), "--mmproj",
              str(projector), "--image", str(tmp_path / "a.png"), "--temp", "0", "--threads", "1",
              "--max-tokens", "12"]
    plain, spec = localspec(*common, "--draft", "0", "Say it"), localspec(*common, "--draft", "4", "Say it")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr[-2000:] + spec.stderr[-2000:]
    assert plain.stdout == spec.stdout and plain.stdout.strip()


@pytest.mark.parametrize(("extra", "why"), [
    (["--image", "{tmp}/bad.png"], "bad.png: not a picture localspec reads"),
    (["--image", "{tmp}/a.png", "--no-mmproj"], "--image needs the target's projector: --mmproj PATH"),
])
def test_generate_refuses_a_bad_image_in_one_line_before_loading(tiny_pair_high, projector, tmp_path, extra, why):
    (tmp_path / "a.png").write_bytes(png(8, 8))
    (tmp_path / "bad.png").write_bytes(b"GIF87a? no")
    args = ["generate", "--target", str(tiny_pair_high[0]), "--draft", "none", "--threads", "1"]
    if "--no-mmproj" not in extra:
        args += ["--mmproj", str(projector)]
    args += [e.format(tmp=tmp_path) for e in extra if e != "--no-mmproj"] + ["hi"]
    done = localspec(*args)
    assert done.returncode == 2 and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# -- the server: image_url parts -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_server_reads_image_url_parts_and_refuses_bad_ones_with_400(tiny_pair_high, projector, tmp_path):
    """Through the official client on a real port: a data: URI picture with speculation answers what it answers
    without (greedy), /props says vision; a bad picture, an http URL and a picture without a projector are a 400
    naming the part."""
    import base64

    import httpx
    import openai

    from tests.test_serve import Server

    home = tmp_path / "home"
    home.mkdir()
    uri = "data:image/png;base64," + base64.b64encode(png(40, 24, 1)).decode()

    def ask(client: openai.OpenAI, url: str, **extra: object) -> str:
        r = client.chat.completions.create(model="target", max_tokens=12, temperature=0, extra_body=extra,
                                           messages=[{"role": "user", "content": [
                                               {"type": "text", "text": "What is this?"},
                                               {"type": "image_url", "image_url": {"url": url}}]}])
        return r.choices[0].message.content or ""

    s = Server(home, tmp_path, "--target", str(tiny_pair_high[0]), "--draft", str(tiny_pair_high[1]), "--mmproj",
               str(projector), "--threads", "1", "--always-draft")
    try:
        client = s.client()
        assert httpx.get(f"{s.root}/props", timeout=10).json()["modalities"]["vision"] is True
        spec = ask(client, uri, **{"speculative.n_max": 4})
        assert spec and spec == ask(client, uri, **{"speculative.type": "none"})
        bad = "data:image/png;base64," + base64.b64encode(png(40, 24, 1)[:70]).decode()
        for url, needle in ((bad, "messages[0] picture 1: truncated or corrupt"),
                            ("https://example.com/a.png", "picture URLs are not fetched"),
                            ("data:image/png;base64,@@@", "does not decode")):
            with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
                ask(client, url)
        with pytest.raises(openai.BadRequestError, match=re.escape("5 pictures; a request may carry 4 ([images]")):
            client.chat.completions.create(model="target", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}} for _ in range(5)]}])
        # a picture of a few MB fits the body (the limit makes room for max_images of them beside the text)
        big = "data:image/png;base64," + base64.b64encode(png(1024, 1024, 5)).decode()
        assert len(big) > 3 << 20 and ask(client, big)
        assert ask(client, uri, **{"speculative.n_max": 4}) == spec  # (the server goes on serving)
        # llama-server's own route: {prompt_string, multimodal_data}, a picture where each marker stands
        raw = base64.b64encode(png(40, 24, 1)).decode()

        def native(**prompt: object) -> httpx.Response:
            return httpx.post(f"{s.root}/completion", timeout=120, json={
                "prompt": prompt, "n_predict": 8, "temperature": 0, "speculative.n_max": 4})

        first = native(prompt_string="<__media__>\nWhat is this?", multimodal_data=[raw])
        assert first.status_code == 200, first.text
        assert "<start_of_image><__media__><end_of_image>" in first.json()["prompt"] and first.json()["content"]
        for body, needle in (({"prompt_string": "<__media__> and <__media__>", "multimodal_data": [raw]},
                              "2 picture markers (<__media__>) for 1 pictures"),
                             ({"prompt_string": "<__media__>", "multimodal_data": ["@@"]},
                              "prompt.multimodal_data[0]: its base64 data does not decode"),
                             ({"prompt_string": "x", "images": [raw]}, "(unknown field 'images')")):
            bad_reply = native(**body)
            assert bad_reply.status_code == 400 and needle in bad_reply.json()["error"]["message"], bad_reply.text
    finally:
        s.stop()
    s = Server(home, tmp_path, "--target", str(tiny_pair_high[0]), "--draft", "none", "--threads", "1")
    try:
        assert httpx.get(f"{s.root}/props", timeout=10).json()["modalities"]["vision"] is False
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\] picture 1: this model reads no pictures"):
            ask(s.client(), uri)
    finally:
        s.stop()


# -- chat: /image -----------------------------------------------------------------------------------------------


def test_chat_attaches_a_picture_to_the_next_message_and_keeps_it_in_the_history(tiny_pair_high, projector,
                                                                                  tmp_path):
    from localspec.errors import LocalspecError
    from localspec.sessions.chat import ChatSession, parse_command

    assert parse_command("/image cat.png").arg == "cat.png"
    (tmp_path / "a.png").write_bytes(png(40, 24, 1))
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    preset = GREEDY.with_overrides(n_draft=4)
    with open_session(files(tiny_pair_high, projector), preset) as s:
        chat = ChatSession(s.engine, s.target, preset, max_tokens=8)
        with pytest.raises(ImageError, match=r"bad\.png: "):
            chat.attach(tmp_path / "bad.png")
        assert chat.attach(tmp_path / "a.png").width == 40 and len(chat.attached) == 1
        with pytest.raises(LocalspecError, match="picture marker"):
            list(chat.send("look: <__media__>"))
        list(chat.send("What is it?"))
        first = chat.turns[-1]
        assert first.pictures == 1 and not chat.attached and first.stats.drafted > 0
        prompt_one = chat.prompt_tokens(chat.messages[:-1])
        assert sum(t < 0 for t in prompt_one) == 16
        # the reply matches the engine alone on the same prompt
        s.engine.reset()
        alone = collect(s.engine.generate(**request(prompt_one, 4, max_tokens=8)))
        assert s.target.detokenize(alone.tokens).strip() == first.reply
        list(chat.send("And again?"))
        second = chat.turns[-1]
        assert second.pictures == 0 and sum(t < 0 for t in chat.prompt_tokens()) == 16  # the picture stays, once
        with pytest.raises(LocalspecError, match="holds a picture"):
            chat.save(tmp_path / "chat.json")
        assert not (tmp_path / "chat.json").exists() and not (tmp_path / "chat.json.kv").exists()
    with open_session(files(tiny_pair_high, None), preset) as plain, \
            pytest.raises(UsageError, match="/image needs the target's projector"):
        ChatSession(plain.engine, plain.target, preset).attach(tmp_path / "a.png")


# -- memory: the projector in the plan, doctor -------------------------------------------------------------------


def header_only_projector(path: Path, image_size: int, patch_size: int, heads: int, n_ff: int,
                          kind: str = "gemma3") -> Path:
    """A projector's header without tensors (doctor and the memory plan read headers only)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="clip")
    w.add_string("clip.projector_type", kind)
    for key, value in (("image_size", image_size), ("patch_size", patch_size), ("attention.head_count", heads),
                       ("feed_forward_length", n_ff), ("embedding_length", 1152)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_the_memory_plan_counts_the_projector_with_the_target(tiny_pair_high, projector, tmp_path):
    from localspec.models import memory
    from localspec.models.gguf_header import read_header

    t, d = read_header(tiny_pair_high[0]), read_header(tiny_pair_high[1])
    header = read_header(projector)
    weights, compute = memory.projector_memory(header)
    assert weights == header.tensor_bytes > 0
    # 8 x 8 patches, 2 heads of 16 (no CUDA flash attention at that width: the scores counted), n_ff 64
    assert compute == 4 * (64 * 64 * 2 + 4 * 64 * 64)
    devices = memory.Devices(ram_available=64 * 2**30)
    plain = memory.estimate(t, d, memory.settings_from_preset(GREEDY), devices)
    with_it = memory.estimate(t, d, memory.settings_from_preset(GREEDY, projector=header), devices)
    assert with_it.models[0].total - plain.models[0].total == weights + compute
    assert with_it.models[1] == plain.models[1]  # (the draft reads no pictures)
    # Gemma 3's projector (SigLIP at 896 px, patches of 14, 16 heads of 72: flash attention runs): the activations
    siglip = read_header(header_only_projector(tmp_path / "siglip.gguf", 896, 14, 16, 4304))
    assert memory.projector_flash_attention(siglip)
    assert memory.projector_memory(siglip)[1] == 4 * 4 * 4096 * 4304
    # ... and with heads of 48 (1152 / 24), which CUDA's flash attention does not run: every score too, ~1.6 GiB
    odd = read_header(header_only_projector(tmp_path / "odd.gguf", 896, 14, 24, 4304))
    assert not memory.projector_flash_attention(odd)
    assert memory.projector_memory(odd)[1] == 4 * (4096 * 4096 * 24 + 4 * 4096 * 4304)


def test_the_projector_loads_warmed_up_with_flash_attention(tiny_pair_high, projector) -> None:
    """libmtmd reserves the tower's compute buffer at load and turns flash attention on, as llama-server loads a
    projector (warm-up off, it never tries flash attention: a Qwen-VL picture then holds every patch's scores,
    ~17 GiB at 4096 tokens). Read from clip.cpp's own log, in a process of its own."""
    code = ("from localspec.sessions.session import ModelFiles, open_session; from localspec.config import "
            "load_preset; import sys\n"
            f"with open_session(ModelFiles(target={str(tiny_pair_high[0])!r}, draft={str(tiny_pair_high[1])!r}, "
            "name='t', "
            f"mmproj={str(projector)!r}), load_preset('greedy')) as s: pass")
    env = {**os.environ, "LOCALSPEC_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warmup: flash attention is enabled" in done.stderr
    assert re.search(r"compute buffer size = +[\d.]+ MiB", done.stderr)


def test_doctor_counts_the_projector_and_says_what_fits_a_24_gb_card(tiny_pair_high, projector, tmp_path):
    from localspec.models import doctor
    from localspec.status import Status

    def checks(mmproj: Path) -> dict[str, doctor.Check]:
        found = doctor.run_checks(tiny_pair_high[0], tiny_pair_high[1], GREEDY, mmproj=mmproj)
        return {c.name: c for c in found}

    good = checks(projector)
    assert good["projector"].status == Status.OK and "gemma3" in good["projector"].detail
    assert good["on a 24 GiB card"].status == Status.OK
    bad = checks(tiny_pair_high[0])
    assert bad["projector"].status == Status.FAIL and "not a projector" in bad["projector"].detail
    # a projector whose picture needs more than the card holds: a warning with what would fit
    huge = checks(header_only_projector(tmp_path / "huge.gguf", 2048, 4, 64, 4096))
    assert huge["on a 24 GiB card"].status == Status.WARN and "no context fits" in huge["on a 24 GiB card"].detail


@pytest.mark.slow
def test_sampling_after_a_picture_preserves_the_target_distribution(tiny_pair_high, projector):
    """At T > 0 the first token after a prompt with a picture follows the target's own p (read from its full logits
    after the picture), whether the draft's token is accepted or resampled."""
    from collections import Counter

    from localspec.rounds.sampling import candidates
    from tests.helpers_stats import chi_square

    preset = GREEDY.with_overrides(temperature=1.5, top_k=6, top_p=1.0)
    with open_session(files(tiny_pair_high, projector), preset) as s:
        tokens = prompt(s, "Name it:", [picture(7)])
        s.engine.reset()
        s.target.use_device_sampler(None, 0)
        p = candidates(s.target.decode(tokens, 0, seq=0).logits, preset.sampling)
        s.engine.reset()
        firsts: Counter[int] = Counter()
        accepted = 0
        for seed in range(1200):
            r = request(tokens, 1, max_tokens=2)
            r["sampling"] = dataclasses.replace(preset.sampling, seed=seed)
            run = collect(s.engine.generate(**r))
            firsts[run.tokens[0]] += 1
            accepted += run.done.stats.accepted
    assert 0 < accepted < 1200  # both branches: accepted drafts and resampled rejections
    p_first = dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))
    assert chi_square(firsts, p_first) < 20.5  # 5 degrees of freedom at p = 0.001


def test_a_prompt_cache_entry_with_a_picture_serves_a_later_prompt_exactly(tiny_pair_high, projector):
    """A slot given to another prompt goes to the prompt cache with its picture's cells; the conversation that
    comes back is served from there (its picture not read again) and answers what a fresh slot answers."""
    with open_session(files(tiny_pair_high, projector), GREEDY, prompt_cache=True) as s:
        first = prompt(s, "Tell me about it.", [picture(1)])
        collect(s.engine.generate(**request(first, 4)))
        collect(s.engine.generate(**request(prompt(s, "Something else entirely, and longer than that.",
                                                   [picture(2)]), 4)))
        back = first + first[-3:]
        served = collect(s.engine.generate(**request(back, 4)))
        assert served.done.stats.prompt_tokens_processed < len(back) - 16  # the picture came from the cache
        s.engine.reset()
        s.engine.prompt_cache.clear()
        assert collect(s.engine.generate(**request(back, 4))).tokens == served.tokens


@pytest.mark.slow
def test_the_concurrency_client_sends_a_picture_with_every_request(tiny_pair_high, projector, tmp_path, capsys):
    """bench/concurrency.py --image (what concurrency.sh's MMPROJ runs send both servers): every request carries the
    picture, the server reads it (the prompt holds its 16 positions), and a file that is no PNG or JPEG is one line."""
    import concurrency

    from tests.test_serve import Server

    (tmp_path / "p.png").write_bytes(png(40, 24, 3))
    (tmp_path / "no.gif").write_bytes(b"GIF89a....")
    home = tmp_path / "home"
    home.mkdir()
    s = Server(home, tmp_path, "--target", str(tiny_pair_high[0]), "--draft", str(tiny_pair_high[1]), "--mmproj",
               str(projector), "--threads", "1", "--parallel", "2")
    try:
        out = tmp_path / "conc.json"
        rc = concurrency.main(["--url", s.url, "--clients", "1,2", "--requests-per-client", "1", "--max-tokens", "8",
                               "--image", str(tmp_path / "p.png"), "--json", str(out)])
        assert rc == 0, capsys.readouterr()
        data = json.loads(out.read_text())
        assert data["settings"]["image"]["bytes"] == (tmp_path / "p.png").stat().st_size
        for level in data["levels"]:
            assert level["errors"] == 0
            for r in level["results"]:  # (the picture's 16 positions and its wrapping text came before the prompt)
                assert r["timings"]["prompt_n"] + r["timings"].get("cache_n", 0) > 16
        capsys.readouterr()  # (the run above: its progress lines)
        assert concurrency.main(["--url", s.url, "--clients", "1", "--image", str(tmp_path / "no.gif")]) == 1
        err = capsys.readouterr().err
        assert err.strip() == f"concurrency.py: error: --image {tmp_path / 'no.gif'}: not a PNG or JPEG file"
    finally:
        s.stop()


def test_a_projector_in_f16_as_published_loads_and_reads_a_picture(tiny_pair_high, tmp_path):
    """bench/synthetic.py writes the GPU run's projector with F16 matrices (as mmproj-*-f16.gguf files hold them):
    the same layout in small loads and reads a picture, speculation equal to plain decoding with it."""
    from synthetic import TINY_HIGH, ProjectorSpec, gemma3_projector, write_projector

    big = gemma3_projector(5120)
    assert (big.n_image_tokens, big.n_layer, big.f16) == (256, 27, True)
    small = write_projector(tmp_path / "f16.gguf", ProjectorSpec(n_embd_text=TINY_HIGH.n_embd, f16=True,
                                                                 projection_std=1.0))
    with open_session(files(tiny_pair_high, small), GREEDY) as s:
        tokens = prompt(s, "Say:", [picture(4)])
        plain = collect(s.engine.generate(**request(tokens, 0, max_tokens=12)))
        s.engine.reset()
        assert collect(s.engine.generate(**request(tokens, 4, max_tokens=12))).tokens == plain.tokens


# -- llama.cpp's projector loader aborts on two malformed layouts: canaries, and the one-line refusals -------------

CANARY = """
import ctypes, sys
import llama_cpp
from llama_cpp import mtmd_cpp as m
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
p = m.mtmd_context_params_default()
p.use_gpu, p.warmup, p.n_threads = False, False, 1
ctx = m.mtmd_init_from_file(sys.argv[2].encode(), model, p)
if not ctx:
    sys.exit(3)
rgb = bytes(range(256)) * 12
bitmap = m.mtmd_bitmap_init(32, 32, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb[:3072]))
chunks = m.mtmd_input_chunks_init()
text = m.mtmd_input_text()
text.text, text.text_len, text.add_special, text.parse_special = b"<__media__>", 11, False, True
assert m.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
for i in range(m.mtmd_input_chunks_size(chunks)):
    chunk = m.mtmd_input_chunks_get(chunks, i)
    if m.mtmd_input_chunk_get_type(chunk) == m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
        m.mtmd_encode_chunk(ctx, chunk)
print("survived")
"""


@pytest.mark.parametrize("hostile", ["int32 key", "f16 positions"])
def test_llama_cpp_aborts_on_malformed_projectors_and_localspec_refuses_them_first(tiny_pair_high, tmp_path,
                                                                                   hostile):
    """Canary: llama.cpp 0.3.36's libmtmd aborts the whole process on a projector whose integer key is stored as
    int32 (gguf_get_val_u32's assert) and, on the CPU, on F16 position embeddings (an unsupported add) — each
    reproduced in a child process; when this fails, upstream fixed it and the check can go. localspec refuses both
    in one line before libmtmd sees them."""
    from synthetic import TINY_HIGH, ProjectorSpec, write_projector

    spec = ProjectorSpec(n_embd_text=TINY_HIGH.n_embd)
    bad = write_projector(tmp_path / "bad.gguf", spec, int32_keys=("patch_size",) if hostile == "int32 key" else (),
                          position_f16=hostile == "f16 positions")
    child = subprocess.run([sys.executable, "-c", CANARY, str(tiny_pair_high[0]), str(bad)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -6 and "survived" not in child.stdout, (child.returncode, child.stderr[-500:])
    why = "clip.vision.patch_size is stored as int32" if hostile == "int32 key" else "F16; on the CPU llama.cpp"
    with pytest.raises(ModelLoadError, match=re.escape(why)):
        open_session(files(tiny_pair_high, bad), GREEDY)


def test_the_body_limit_makes_room_for_pictures_only_with_a_projector():
    from types import SimpleNamespace

    from localspec.server.guard import PromptLimits, picture_room

    room = picture_room(LIMITS, SimpleNamespace(projector=object()))
    assert room == LIMITS.max_images * (4 * -(-LIMITS.max_image_bytes // 3) + 64)
    assert picture_room(LIMITS, SimpleNamespace(projector=None)) == 0
    assert PromptLimits(65536, 16, room).body_bytes == PromptLimits(65536, 16).body_bytes + room


def test_a_prompt_keeps_its_pictures_however_many_arrive_and_ids_without_one_are_refused(tiny_pair_high, projector):
    """A queued prompt's pictures stay decodable while it lives, whatever comes after it (no eviction by count);
    placeholder ids whose prompt is gone (or were copied out of it) are refused at start, before any decode."""
    import gc

    with open_session(files(tiny_pair_high, projector), GREEDY) as s:
        held = prompt(s, "First:", [picture(1)])
        later = [prompt(s, f"Then {i}:", [picture(100 + i, 8, 8)]) for i in range(80)]  # (more than any cache size)
        assert collect(s.engine.generate(**request(held, 4, max_tokens=4))).tokens
        copied = list(later[0])  # the ids alone: the list that held the picture goes
        del later
        gc.collect()
        s.engine.reset()
        with pytest.raises(ImageError, match="a picture's ids without its picture"):
            next(s.engine.generate(**request(copied, 4, max_tokens=4)))


@pytest.mark.slow
def test_chat_in_a_terminal_attaches_a_picture_with_slash_image(tiny_pair_high, projector, tmp_path):
    """`localspec chat --mmproj`: `/image PATH` says what it attached, the next message carries it (its prompt
    holds the picture's positions), a bad file is one red line and the chat goes on."""
    import pexpect

    from tests.test_chat_tty import command, spawn, turn

    (tmp_path / "a.png").write_bytes(png(40, 24, 1))
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    home = tmp_path / "home"
    home.mkdir()
    child = spawn(home, "--target", str(tiny_pair_high[0]), "--draft", str(tiny_pair_high[1]), "--mmproj",
                  str(projector), "--max-tokens", "6", "--temp", "0", "--threads", "1")
    try:
        assert "not a picture localspec reads" in command(child, f"/image {tmp_path / 'bad.png'}", "reads")
        assert "(40 x 24) goes with your next message (1 attached)" in command(
            child, f"/image {tmp_path / 'a.png'}", r"attached\)")
        _, stats = turn(child, "What is it?")
        assert int(stats.group(3)) > 16  # prompt tokens processed: the picture's 16 positions and the text
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


# -- the refusals that need no picture decoded ---------------------------------------------------------------------


def test_a_slot_file_refuses_cells_that_hold_a_picture(tmp_path):
    from localspec.rounds import slot_file
    from localspec.rounds.prompt_cache import ModelState, SlotState

    state = SlotState((5, 6, -7, -8, 9), (ModelState(5, bytearray(b"x"), 0),))
    identity = slot_file.ModelIdentity("t.gguf", "f" * 64, "f16", 1)
    with pytest.raises(slot_file.SlotFileError, match="s.bin: the slot file's cells hold a picture"):
        slot_file.write(tmp_path / "s.bin", state, [identity])
    assert not (tmp_path / "s.bin").exists()


def test_a_gemma3_projector_beside_a_hybrid_target_places_its_pictures_as_the_text_model_reads(hybrid_pair,
                                                                                                tmp_path):
    """libmtmd places pictures by the text model's rope type: beside the (M-RoPE) hybrid a Gemma 3-type projector's
    picture takes M-RoPE positions too, laid out as one row (as many positions as tokens: the target's cells keep no
    gap for it); plain decoding and the draft model agree with it."""
    from synthetic import ProjectorSpec, write_projector

    from localspec.models.gguf_header import read_header

    width = read_header(hybrid_pair[0]).arch_get("embedding_length")
    mmproj = write_projector(tmp_path / "h.gguf", ProjectorSpec(n_embd_text=width, projection_std=0.5))
    with open_session(files(hybrid_pair, mmproj), GREEDY) as s:
        tokens = prompt(s, "What is it?", [picture(1)])
        assert s.target.projector.mrope
        plain = collect(s.engine.generate(**request(tokens, 0)))
        assert sum(t < 0 for t in tokens) == 16 and s.target.save_state(0).gaps == ()
        s.engine.reset()
        assert collect(s.engine.generate(**request(tokens, 4))).tokens == plain.tokens


def test_serve_refuses_a_projector_for_several_pairs(tmp_path):
    done = localspec("serve", "--pair", "demo", "--pair", "demo-chat", "--mmproj", str(tmp_path / "m.gguf"))
    assert done.returncode == 2 and "--mmproj with several --pair: a projector fits one target" in done.stderr


@pytest.mark.parametrize(("kind", "projector_type", "tokens"), [("tiny", "gemma3", 16), ("gemma3", "gemma3", 256),
                                                                ("qwen-vl", "qwen2vl_merger", None)])
def test_synthetic_writes_each_projector_kind_for_the_sizes_width(monkeypatch, tmp_path, kind, projector_type, tokens):
    """`bench/synthetic.py --projector KIND` (bench/gpu/concurrency.sh's MMPROJ): the kind's spec at the size's text
    width (a hybrid size's target's), to <prefix>mmproj.gguf. The writer is captured: the real-size towers are ~0.9
    GB (test_a_projector_in_f16_as_published_loads_and_reads_a_picture loads the same layout in small)."""
    import synthetic

    written = {}

    def capture(path, spec):
        written[path] = spec
        return path
    monkeypatch.setattr(synthetic, "write_projector", capture)
    assert synthetic.main(["--size", "hybrid27b", "--projector", kind, "--prefix", "x-", "--out", str(tmp_path)]) == 0
    ((path, spec),) = written.items()
    assert path == tmp_path / "x-mmproj.gguf" and spec.kind == projector_type
    assert spec.n_embd_text == synthetic.HYBRID_PRESETS["hybrid27b"].target.n_embd
    if tokens is not None:
        assert spec.n_image_tokens == tokens
    if kind == "qwen-vl":  # Qwen3.5/3.6's tower at its real dimensions
        assert (spec.n_embd, spec.n_layer, spec.patch_size, spec.f16) == (1152, 27, 16, True)
