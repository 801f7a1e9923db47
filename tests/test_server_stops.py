"""The stop-string matcher: nothing at or past a stop string is released, however the text is split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localspec.server.stops import StopMatcher

# A small alphabet (with a multi-byte character and an emoji) so stops actually occur in the generated texts.
ALPHABET = st.sampled_from("ab é😀\n")
TEXT = st.text(ALPHABET, max_size=40)
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4)


def run(stops: list[str], pieces: list[str]) -> tuple[str, StopMatcher, list[str]]:
    matcher = StopMatcher(stops)
    released = [matcher.feed(p) for p in pieces]
    released.append(matcher.flush())
    return "".join(released), matcher, released


def expected(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The reference, the obvious way: after each piece, if the text so far holds a stop string, the reply is the
    text before the earliest one and generation ends there (as soon as a stop completes, not later)."""
    seen = ""
    for piece in pieces:
        seen += piece
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            return seen[: min(hits)], True
    return seen, False


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A text cut into pieces at arbitrary points, empty pieces included (a token that completes no character)."""
    text = draw(TEXT)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=2000, deadline=None)
@given(split_text(), STOPS)
def test_released_text_is_the_text_before_the_first_stop(case, stops):
    text, pieces = case
    out, matcher, _ = run(stops, pieces)
    want, stopped = expected(pieces, stops)
    assert out == want
    assert matcher.released == len(want)
    assert (matcher.matched is not None) == stopped
    assert not any(s in out for s in stops)
    if stopped:  # the reply is followed, in the generated text, by the stop string that ended it
        assert matcher.matched is not None and text[len(want):].startswith(matcher.matched)
    else:
        assert out == text


@settings(max_examples=1000, deadline=None)
@given(split_text(), STOPS)
def test_holds_back_only_what_could_still_become_a_stop(case, stops):
    text, pieces = case
    matcher = StopMatcher(stops)
    seen = ""
    out = ""
    for piece in pieces:
        seen += piece
        out += matcher.feed(piece)
        if matcher.matched is not None:
            break
        held = seen[len(out):]
        assert seen.startswith(out)
        assert len(held) < max(len(s) for s in stops)  # never more than a stop's length minus one
        assert held == "" or any(s.startswith(held) for s in stops)  # a stop's beginning, nothing else
        assert not any(s in out for s in stops)


def test_stop_split_across_pieces_and_nothing_after():
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("the answer is 4</an") == "the answer is 4"
    assert matcher.feed("swer> and more") == ""
    assert matcher.matched == "</answer>"
    assert matcher.feed("even more") == "" and matcher.flush() == ""


def test_partial_stop_that_never_completes_is_released():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("OP") == ""  # completes it: nothing
    other = StopMatcher(["STOP"])
    assert other.feed("a ST") == "a " and other.feed("ep") == "STep"
    assert other.feed("S") == "" and other.flush() == "S"


def test_multibyte_character_arriving_after_an_empty_piece():
    matcher = StopMatcher(["é!"])
    assert matcher.feed("caf") == "caf"
    assert matcher.feed("") == ""  # first byte of é: the decoder gave nothing yet
    assert matcher.feed("é") == ""
    assert matcher.feed("!") == "" and matcher.matched == "é!" and matcher.released == 3


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])
