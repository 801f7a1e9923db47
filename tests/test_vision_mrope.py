"""Pictures placed with M-RoPE positions (Qwen2/2.5/3-VL projectors, and Qwen3.5/3.6 built on them): a picture of
nx x ny tokens takes max(nx, ny) positions, so past it a cell's index is not its position (llama.places). On the
tiny Qwen3.5-shaped hybrid target (Gated DeltaNet + attention, interleaved M-RoPE) with a synthetic
`qwen2vl_merger` projector, through the real libmtmd: speculation with the picture equals plain decoding with it and
libmtmd's own helper path in a context of its own (the next token's logits bit for bit), for every drafter, in
several slots, and through the prompt cache; a rewind never keeps part of a picture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localspec.llama.places import Gap, Places
from localspec.rounds.events import collect
from localspec.sessions.session import open_session
from tests.test_vision import GREEDY, files, picture, prompt, reference_greedy, request, slots_match_alone

TEXT = "Describe the picture in a few words, then the picture again:"


@pytest.fixture(scope="module")
def mrope_projector(tmp_path_factory) -> Path:
    from synthetic import HYBRID_TINY, ProjectorSpec, write_projector

    return write_projector(tmp_path_factory.mktemp("mmproj") / "qwen2vl.gguf",
                           ProjectorSpec(n_embd_text=HYBRID_TINY.target.n_embd, kind="qwen2vl_merger",
                                         projection_std=0.5))


def test_places_translate_indexes_and_positions_around_whole_pictures():
    """Two pictures (15 cells at 5 positions from index 7; 6 cells at 3 from 30): positions past each come 10 and 3
    earlier; a cell inside a picture sits at its first position; cutting inside one keeps its start."""
    places = Places()
    assert not places and places.pos(0, 50) == 50 and places.index(0, 50) == 50
    places.add(0, 7, 15, 5)
    places.add(0, 30, 6, 3)
    places.add(0, 40, 4, 4)  # (as many positions as cells: nothing to keep)
    assert places.gaps(0) == (Gap(7, 15, 5), Gap(30, 6, 3)) and places.gaps(1) == ()
    assert [places.pos(0, i) for i in (0, 6, 7, 8, 21, 22, 29, 30, 35, 36, 40)] == [0, 6, 7, 7, 7, 12, 19, 20, 20,
                                                                                   23, 27]
    # positions back to kept cells: everything before the first cut position stays, a picture whole
    assert [places.index(0, p) for p in (0, 7, 8, 11, 12, 19, 20, 21, 23, 27)] == [0, 7, 22, 22, 22, 29, 30, 36, 36,
                                                                                  40]
    assert [places.start(0, i) for i in (7, 8, 21, 22, 31, 36)] == [7, 7, 7, 22, 30, 36]
    places.cut(0, 29)
    assert places.gaps(0) == (Gap(7, 15, 5),)
    places.cut(0, 7)
    assert places.gaps(0) == () and not places


def test_an_mrope_picture_on_a_hybrid_target_is_plain_decoding_with_it(hybrid_pair, mrope_projector):
    """The next token's logits after the prompt are libmtmd's helper path's bit for bit (positions past the picture
    are what libmtmd gives them: placing the text at its index would move them), and greedy output with every
    drafter that reads no target rows equals that path's; another picture gives other logits."""
    pictures = [picture(1)]
    expected, expected_row = reference_greedy(hybrid_pair[0], mrope_projector, TEXT, pictures, 24, with_row=True)
    with open_session(files(hybrid_pair, mrope_projector), GREEDY) as s:
        tokens = prompt(s, TEXT, pictures)
        assert sum(t < 0 for t in tokens) == 15  # 40 x 24 px: 5 x 3 merged patches of 8 px, at 5 positions
        assert s.target.projector.mrope  # (libmtmd's choice, by the text model's rope type)
        runs = {}
        for name, k in (("plain", 0), ("model", 4), ("lookup", 4), ("chain", 4)):
            s.engine.reset()
            runs[name] = collect(s.engine.generate(**request(tokens, k, "model" if name == "plain" else name)))
        assert all(r.tokens == expected for r in runs.values()), {n: r.tokens for n, r in runs.items()}
        stats = runs["model"].done.stats
        assert stats.drafted > stats.accepted  # (rejected drafts: rewinds of text past the picture)
        s.engine.reset()
        s.target.use_device_sampler(None, 0)  # full logits
        row = s.target.decode(tokens, 0, seq=0).logits[-1].copy()
        np.testing.assert_array_equal(row, expected_row)
        assert s.target.save_state(0).gaps == (Gap(tokens.index(next(t for t in tokens if t < 0)), 15, 5),)
        s.engine.reset()
        other = s.target.decode(prompt(s, TEXT, [picture(2)]), 0, seq=0).logits[-1]
        assert np.abs(other - expected_row).max() > 1e-3


@pytest.mark.parametrize("n_batch", [8, 12])
def test_an_mrope_picture_larger_than_a_batch_is_decoded_a_batch_at_a_time(hybrid_pair, mrope_projector, n_batch):
    """A Qwen-VL picture attends causally, as text does, so libmtmd may decode it n_batch tokens at a time (a
    Qwen3.6 picture of 1024 x 768 pixels is 768 tokens, over the default 512; llama-server reads it): with n_batch 8
    or 12 under the picture's 15 tokens (its batches split the text around it too), the next token's logits are
    libmtmd's helper path's at that batch bit for bit, and greedy output with the MTP head and the draft model equals
    that path's. (Was refused: "does not fit one batch".)"""
    pictures = [picture(1)]
    expected, expected_row = reference_greedy(hybrid_pair[0], mrope_projector, TEXT, pictures, 24, with_row=True,
                                              n_batch=n_batch)
    with open_session(files(hybrid_pair, mrope_projector), GREEDY.with_overrides(n_batch=n_batch)) as s:
        assert s.target.n_batch == n_batch
        tokens = prompt(s, TEXT, pictures)
        assert sum(t < 0 for t in tokens) == 15  # (the premise: more than one batch)
        for drafter, k in (("model", 0), ("mtp", 3), ("model", 4)):
            s.engine.reset()
            assert collect(s.engine.generate(**request(tokens, k, drafter))).tokens == expected, (drafter, k)
        s.engine.reset()
        s.target.use_device_sampler(None, 0)  # full logits
        np.testing.assert_array_equal(s.target.decode(tokens, 0, seq=0).logits[-1], expected_row)


def test_mrope_pictures_over_a_batch_in_several_slots_each_get_what_they_get_alone(hybrid_pair, mrope_projector):
    """Pictures decoded a batch at a time (n_batch 8) in slots whose rounds interleave with them, on the hybrid target
    whose recurrent cells llama.cpp moves between decodes: each request as it is alone."""
    slots_match_alone(hybrid_pair, mrope_projector, [
        ("One:", [picture(1)], 3, "mtp"), ("Two pictures, compare them:", [picture(2), picture(4, 24, 40)], 3,
                                           "lookup"), ("Three, in a sentence:", [picture(5)], 0, "model")],
                      GREEDY.with_overrides(n_batch=8))


def test_mrope_pictures_in_several_slots_each_get_what_they_get_alone(hybrid_pair, mrope_projector):
    """One picture wide, two (one tall) in another request, each slot's own places; the MTP head in one slot."""
    slots_match_alone(hybrid_pair, mrope_projector, [
        ("One:", [picture(1)], 3, "mtp"), ("Two pictures, compare them:", [picture(2), picture(4, 24, 40)], 3,
                                           "lookup"), ("Three, in a sentence:", [picture(5)], 0, "model")])


def test_a_prompt_cache_entry_with_an_mrope_picture_serves_a_later_prompt_exactly(hybrid_pair, mrope_projector):
    """The restored cells carry where their picture sits: the returning conversation's new text goes on at the
    picture-shortened positions (else its answer differs from a fresh slot's)."""
    with open_session(files(hybrid_pair, mrope_projector), GREEDY, prompt_cache=True) as s:
        first = prompt(s, "Tell me about it.", [picture(1)])
        answer = collect(s.engine.generate(**request(first, 4)))
        collect(s.engine.generate(**request(prompt(s, "Something else entirely, and longer than that.",
                                                   [picture(2)]), 4)))
        back = first + answer.tokens + first[-3:]
        served = collect(s.engine.generate(**request(back, 4)))
        assert served.done.stats.prompt_tokens_processed <= 4  # the picture and the first answer from the cache
        s.engine.reset()
        s.engine.prompt_cache.clear()
        assert collect(s.engine.generate(**request(back, 4))).tokens == served.tokens



@pytest.mark.parametrize("drafter", ["mtp", "chain-mtp"])
def test_the_mtp_head_drafts_after_an_mrope_picture_exactly(hybrid_pair, mrope_projector, drafter):
    """The head reads the filler token and a zero target row at the picture's positions (the target gives no row
    there) and drafts the text after it: greedy output is libmtmd's helper path's, drafts accepted and rejected; a
    returning conversation through the prompt cache (the head's cells with it) answers as a fresh slot does."""
    pictures = [picture(1)]
    expected = reference_greedy(hybrid_pair[0], mrope_projector, TEXT, pictures, 24)
    with open_session(files(hybrid_pair, mrope_projector), GREEDY, prompt_cache=True) as s:
        tokens = prompt(s, TEXT, pictures)
        run = collect(s.engine.generate(**request(tokens, 3, drafter)))
        assert run.tokens == expected
        assert 0 < run.done.stats.accepted < run.done.stats.drafted
        collect(s.engine.generate(**request(prompt(s, "Another one.", [picture(2)]), 3, drafter)))
        back = tokens + run.tokens + tokens[-3:]
        served = collect(s.engine.generate(**request(back, 3, drafter)))
        assert served.done.stats.prompt_tokens_processed <= 4
        s.engine.reset()
        s.engine.prompt_cache.clear()
        fresh = collect(s.engine.generate(**request(back, 3, drafter)))
        assert fresh.tokens == served.tokens


@pytest.mark.slow
def test_the_server_reads_an_mrope_picture_and_drafts_with_the_mtp_head(hybrid_pair, mrope_projector, tmp_path):
    """A real `localspec serve --mmproj` over HTTP with the official client: an `image_url` part on the hybrid target
    with its M-RoPE projector; the MTP head's and the draft-free replies are the same text, and another picture
    gives another reply."""
    import base64

    from tests.test_serve import Server
    from tests.test_vision import png

    home = tmp_path / "home"
    home.mkdir()
    s = Server(home, tmp_path, "--target", str(hybrid_pair[0]), "--draft", "4", "--mmproj", str(mrope_projector),
               "--threads", "1")
    try:
        client = s.client()

        def ask(seed: int, **extra: object) -> str:
            uri = "data:image/png;base64," + base64.b64encode(png(40, 24, seed)).decode()
            r = client.chat.completions.create(model="target", max_tokens=16, temperature=0, extra_body=extra,
                                               messages=[{"role": "user", "content": [
                                                   {"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": uri}}]}])
            return r.choices[0].message.content or ""

        with_head = ask(1, **{"speculative.type": "mtp"})
        assert with_head and with_head == ask(1, **{"speculative.type": "none"})
        assert ask(2, **{"speculative.type": "mtp"}) != with_head
    finally:
        s.stop()


def test_a_qwen_vl_picture_is_priced_and_capped_at_its_token_limit(hybrid_pair, mrope_projector, tmp_path):
    """A dynamic-resolution projector reads a picture at its own size: the memory plan prices its largest picture at
    libmtmd's 4096 tokens (4 patches each), or at `[images] max_image_tokens`, which libmtmd then holds every
    picture to (a larger one is shrunk)."""
    from localspec.models import memory
    from localspec.models.gguf_header import read_header
    from tests.test_vision import header_only_projector

    qwen3vl = read_header(header_only_projector(tmp_path / "q.gguf", 768, 16, 16, 4304, kind="qwen3vl_merger"))
    assert memory.projector_patches(qwen3vl) == 4096 * 4 and memory.projector_patches(qwen3vl, 1024) == 4096
    # heads of 72 (1152 / 16): flash attention runs, the activations remain (no patch-by-patch scores)
    assert memory.projector_memory(qwen3vl)[1] == 4 * 4 * 4096 * 4 * 4304
    assert memory.projector_memory(qwen3vl, 1024)[1] == 4 * 4 * 4096 * 4304
    capped = GREEDY.with_overrides(max_image_tokens=16)
    assert memory.settings_from_preset(capped, projector=qwen3vl).projector == memory.projector_memory(qwen3vl, 16)
    big = picture(3, 96, 64)  # 12 x 8 merged patches of 8 px: 96 tokens
    with open_session(files(hybrid_pair, mrope_projector), GREEDY) as s:
        assert sum(t < 0 for t in prompt(s, "x", [big])) == 96
    with open_session(files(hybrid_pair, mrope_projector), capped) as s:
        tokens = prompt(s, "x", [big])
        assert 0 < sum(t < 0 for t in tokens) <= 16
        assert collect(s.engine.generate(**request(tokens, 3))).tokens  # (and it reads as any other picture)
