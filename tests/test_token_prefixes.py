"""A whole-vocabulary grammar mask through the vocabulary's prefix forest (`Grammar.legal_everywhere`) must equal
llama.cpp's check of every token, at every grammar state: JSON, tool calls, character classes beyond ASCII and
states in the middle of a UTF-8 character, on a byte-level BPE vocabulary (SmolLM2) and on a SentencePiece one
with byte fallback (Gemma 3); and at a literal it must ask llama.cpp about a small part of the vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localspec.config import load_preset
from localspec.llama.grammar import Grammar
from localspec.llama.model import LlamaModel
from localspec.models import demo
from localspec.rounds.constraints import Constraint, masked_row
from localspec.server.tools import parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
             "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "search_flights", "parameters": {"type": "object", "properties": {
             "origin": {"type": "string"}, "date": {"type": "string"}}, "required": ["origin", "date"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
# Literals and classes beyond ASCII (two-, three- and four-byte characters), any character, a bounded repeat.
UNICODE = 'root ::= "«" [à-ÿ一-龥x]+ "»" .{0,3} ("日本語" | "😀" | [ \\n]) "end"'


def constraints() -> dict[str, Constraint]:
    tools = parse_tools(TOOLS, "required", True)
    assert tools is not None
    return {"json_object": Constraint.json_object("test"), "schema": Constraint.json_schema(SCHEMA, "test"),
            "tools": tools.constraint(), "unicode": Constraint(UNICODE, "unicode")}


class Counting(Grammar):
    """The grammar, counting the token ids it asks llama.cpp about."""

    asked = 0

    def legal(self, ids: np.ndarray) -> np.ndarray:
        self.asked += np.asarray(ids).size
        return super().legal(ids)


def grammar_of(model: LlamaModel, constraint: Constraint) -> Counting:
    return Counting(model, constraint.gbnf, constraint.source, trigger=constraint.trigger)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def vocab_model(request, tiny_pair, demo_home: Path):
    path = tiny_pair[0] if request.param == "smollm2" else demo_home / "cache" / "demo" / demo.TARGET_FILE
    with LlamaModel(path, n_ctx=64, device_top_k=0, n_threads=1, n_gpu_layers=0) as model:
        yield model


def _incomplete_utf8(piece: bytes) -> bool:
    """Whether a token's text ends inside a UTF-8 character (the grammar then holds a partial character)."""
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json_object", "schema", "tools", "unicode"])
def test_the_prefix_forest_mask_equals_the_full_check_at_every_state(vocab_model, kind):
    model = vocab_model
    constraint = constraints()[kind]
    everything = np.arange(model.n_vocab)
    partial = np.array([_incomplete_utf8(model.piece(t, special=True)) for t in range(model.n_vocab)])
    eog = np.array([model.is_eog(t) for t in range(model.n_vocab)])
    rng = np.random.default_rng(11)
    partial_states = 0
    for walk in range(3):
        g = grammar_of(model, constraint)
        try:
            for _ in range(40):
                full = g.legal(everything)
                assert np.array_equal(g.legal_everywhere(), full), (kind, walk, int(full.sum()))
                options = np.flatnonzero(full & ~eog)
                if not len(options):
                    break
                splitting = options[partial[options]]
                # Often into the middle of a character where one can start: the states a byte-level text reaches.
                pool = splitting if len(splitting) and rng.random() < 0.4 else options
                token = int(rng.choice(pool))
                partial_states += bool(partial[token])
                g.accept(token)
        finally:
            g.close()
    if kind in ("json_object", "unicode"):  # free text or classes beyond ASCII: partial characters were reached
        assert partial_states > 0


@pytest.mark.slow
def test_a_literal_asks_about_a_small_part_of_the_vocabulary(vocab_model):
    """At `<tool_call>`'s first character a random row has no legal token among its best: the mask widens to the
    whole vocabulary, yet asks llama.cpp about a few percent of it, and keeps exactly the tokens it allows."""
    model = vocab_model
    tools = constraints()["tools"]
    g = grammar_of(model, tools)
    reference = np.flatnonzero(g.legal(np.arange(model.n_vocab)))
    assert 0 < len(reference) < 20
    g.asked = 0
    row = np.random.default_rng(5).normal(0.0, 3.0, size=model.n_vocab).astype(np.float32)
    row[reference] -= 20.0  # the model is nowhere near the format: its best tokens are all refused
    masked = masked_row(row, g, load_preset("default").sampling)
    assert np.array_equal(np.flatnonzero(np.isfinite(masked)), reference)
    assert g.asked < model.n_vocab // 8, g.asked  # two looks at the row's best, then the forest
    g.asked = 0
    assert np.array_equal(np.flatnonzero(g.legal_everywhere()), reference)
    assert g.asked < model.n_vocab // 20, g.asked  # (Gemma: 6k `<unused…>` tokens follow `<`)
    g.close()


@pytest.mark.slow
def test_a_grammar_of_token_ids_checks_every_token(vocab_model):
    """`<[id]>` matches a token by its id, not its text (a token may be allowed where its prefix is not): such a
    grammar's whole-vocabulary mask asks about every token, and equals the full check."""
    model = vocab_model
    word = model.tokenize(" hello", add_special=False)[-1]
    g = grammar_of(model, Constraint(f'root ::= "a" | <[{word}]> "b"', "ids"))
    g.asked = 0
    mask = g.legal_everywhere()
    assert mask[word] and np.array_equal(mask, g.legal(np.arange(model.n_vocab)))  # (` hell` is refused)
    assert g.asked == 2 * model.n_vocab
    g.close()


@pytest.mark.slow
def test_an_awaiting_grammar_checks_the_marker_only_where_a_token_can_complete_it(vocab_model, monkeypatch):
    """Before `<tool_call>`, every token is allowed but one that completes the marker with text the grammar forbids
    after it: the whole-vocabulary mask equals that token-by-token replay at every tail of the marker, and replays
    only tokens whose text holds its last byte (`>`), not each of the vocabulary's."""
    model = vocab_model
    tools = parse_tools(TOOLS, "auto", True)
    assert tools is not None
    for before in ("", " Sure, <", " Sure, <tool_call", "<tool_"):
        g = grammar_of(model, tools.constraint())
        for t in model.tokenize(before, add_special=False):
            g.accept(t)
        assert g.awaiting
        reference = np.array([g._trigger_is_safe(t) for t in range(model.n_vocab)])
        replayed = []
        check = g._trigger_is_safe
        monkeypatch.setattr(g, "_trigger_is_safe", lambda t, seen=replayed, check=check: seen.append(t) or check(t))
        assert np.array_equal(g.legal_everywhere(), reference), before
        assert all(b">" in model.piece(t, special=True) for t in replayed)
        assert 0 < len(replayed) < model.n_vocab // 20
        if before.endswith("<tool_call"):
            assert not reference.all()  # `>"` and the like complete the marker into text the grammar refuses
        g.close()
