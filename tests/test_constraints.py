"""Constrained generation and logprobs through the real llama.cpp: the grammar mask, greedy identity of constrained
plain and speculative decoding, the constrained target's distribution at T > 0, logprobs against a second context
decoding one token at a time, and the server's response_format / grammar / logprobs fields."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import numpy as np
import pytest

from localspec.config import Drafting, load_preset
from localspec.errors import GrammarError
from localspec.llama.grammar import Grammar
from localspec.llama.model import LlamaModel
from localspec.rounds.constraints import Constraint, masked_row
from localspec.rounds.events import DoneEvent, TokenEvent
from localspec.rounds.sampling import candidates
from localspec.server.errors import ApiError
from localspec.server.structured import chat_logprobs, completion_logprobs, request_constraint
from localspec.sessions.session import ModelFiles, open_session
from tests.helpers_stats import chi_square

# One thread: a busy box stalls llama.cpp's spinning pool; drafts every round: these tests look at drafts (standing
# aside: tests/test_stand_aside.py).
GREEDY = load_preset("greedy").with_overrides(threads=1, stand_aside=False)
LETTERS = 'root ::= [a-z]+ "."'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def drafting(k: int, drafter: str = "model") -> Drafting:
    return dataclasses.replace(GREEDY.draft, n_draft=k, p_min=0.0, adaptive=False, drafter=drafter)


def run(engine, prompt, sampling, k: int, max_tokens: int, constraint: Constraint | None = None,
        constrain_draft: bool = True, logprobs: int | None = None, drafter: str = "model"):
    events, done = [], None
    grammar = constraint.grammar(engine.target) if constraint is not None else None
    for event in engine.generate(prompt, sampling, drafting(k, drafter), max_tokens, grammar=grammar,
                                 constrain_draft=constrain_draft, logprobs=logprobs):
        if isinstance(event, TokenEvent):
            events.append(event)
        else:
            assert isinstance(event, DoneEvent)
            done = event
    return [e.token for e in events], events, done


def open_pair(target, draft, preset=GREEDY):
    return open_session(ModelFiles(target=target, draft=draft, name="test"), preset)


def prompt_of(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, size=length).tolist()


# -- request fields (no model) -----------------------------------------------------------------------------


@pytest.mark.parametrize(("response_format", "grammar", "param", "needle"), [
    ({"type": "yaml"}, None, "response_format.type", "not one of"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None, "response_format.json_schema",
     "expected"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "stict": True}}, None,
     "response_format.json_schema", "'stict'"),
    ({"type": "json_object"}, 'root ::= "a"', "grammar", "one of them"),
    (None, "", "grammar", "GBNF"),
    ("json", None, "response_format", "expected"),
])
def test_bad_constraint_fields_name_the_field(response_format, grammar, param, needle):
    with pytest.raises(ApiError) as info:
        request_constraint(response_format, grammar)
    assert info.value.param == param and needle in info.value.message


def test_logprobs_fields():
    assert chat_logprobs(None, None) is None and chat_logprobs(False, None) is None
    assert chat_logprobs(True, None) == 0 and chat_logprobs(True, 5) == 5
    assert completion_logprobs(3) == 3 and completion_logprobs(None) is None
    for bad in ((1, None), (True, 21), (False, 2), (True, "2")):
        with pytest.raises(ApiError):
            chat_logprobs(*bad)
    with pytest.raises(ApiError, match="0..5"):
        completion_logprobs(6)


@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), [
    ("f", None, None, "tools"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a", "parms": {}}}], None, None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "a"}}], {"type": "function", "function": {"name": "b"}}, None,
     "tool_choice"),
    ([{"type": "function", "function": {"name": "a"}}], "sometimes", None, "tool_choice"),
    ([{"type": "function", "function": {"name": "a"}}], None, "yes", "parallel_tool_calls"),
    (None, "required", None, "tool_choice"),
])
def test_bad_tool_fields_name_the_field(tools, choice, parallel, param):
    from localspec.server.tools import parse_tools

    with pytest.raises(ApiError) as info:
        parse_tools(tools, choice, parallel)
    assert info.value.param == param


def _scan(pieces: list[str]) -> tuple[str, list[dict], list]:
    """Feed the pieces one by one: (content, [{"name", "arguments"}] rebuilt from the deltas as a client does,
    the deltas)."""
    from localspec.server.tools import CallDelta, ToolScanner

    scanner = ToolScanner()
    out = [p for piece in pieces for p in scanner.feed(piece)] + scanner.flush()
    deltas = [p for p in out if isinstance(p, CallDelta)]
    calls: dict[int, dict] = {}
    for d in deltas:
        shaped = d.openai()
        if d.index not in calls:  # the first delta of a call carries its id, type and name
            assert shaped["id"].startswith("call_") and shaped["type"] == "function" and shaped["function"]["name"]
            calls[d.index] = {"name": shaped["function"]["name"], "arguments": ""}
        else:
            assert set(shaped) == {"index", "function"} and set(shaped["function"]) == {"arguments"}
        calls[d.index]["arguments"] += shaped["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert [c["function"]["arguments"] for c in scanner.calls] == [calls[i]["arguments"] for i in sorted(calls)]
    return "".join(p for p in out if isinstance(p, str)), [calls[i] for i in sorted(calls)], deltas


TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Saint-\\"Malo\\"", '
             '"note": "a </tool_call> inside a string", "days": [1, 2, {"x": null}]}}\n</tool_call>\n'
             '<tool_call>{"name": "g", "arguments": {}}</tool_call>')


def test_tool_calls_stream_the_same_however_the_text_is_split():
    """One character at a time, random cuts, a marker cut in two, both calls in one piece: the same content and
    the same calls (each call's arguments fragments concatenate to what the whole reply at once gives, which is
    the JSON text the model wrote)."""
    from localspec.server.tools import TOOL_CLOSE, TOOL_OPEN, split_reply

    content, calls, unfinished = split_reply(TWO_CALLS)
    assert content == "Let me check." and not unfinished
    assert [c["function"]["name"] for c in calls] == ["get_weather", "g"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments == {"city": 'Saint-"Malo"', "note": "a </tool_call> inside a string", "days": [1, 2, {"x": None}]}
    assert calls[0]["function"]["arguments"] == TWO_CALLS[TWO_CALLS.index('{"city"') : TWO_CALLS.index("}}") + 1]
    whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    rng = random.Random(7)
    open_at, close_at = TWO_CALLS.index(TOOL_OPEN), TWO_CALLS.rindex(TOOL_CLOSE)
    splits = {
        "one char at a time": list(TWO_CALLS),
        "the open marker cut": [TWO_CALLS[: open_at + 4], TWO_CALLS[open_at + 4 :]],
        "the last close marker cut": [TWO_CALLS[: close_at + 3], TWO_CALLS[close_at + 3 :]],
        "both calls in one piece": [TWO_CALLS[:5], TWO_CALLS[5:]],
    }
    for seed in range(20):
        cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 30)))
        splits[f"random {seed}"] = [TWO_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(TWO_CALLS)], strict=True)]
    for name, pieces in splits.items():
        assert "".join(pieces) == TWO_CALLS
        sent, streamed, deltas = _scan(pieces)
        assert sent.strip() == content and streamed == whole, name
    # Fed as it is written, a call's arguments go out as they come: many fragments, the name first and once.
    _, _, deltas = _scan(list(TWO_CALLS))
    assert len([d for d in deltas if d.index == 0]) > 20 and deltas[0].name == "get_weather"


def test_tool_call_scanner_holds_back_only_what_it_must():
    from localspec.server.tools import CallDelta, ToolScanner

    scanner = ToolScanner()
    assert scanner.feed("Sure <tool") == ["Sure "]  # "<tool" could begin the marker
    assert scanner.feed('_call>{"name": "f", "arg') == []  # the name is not followed by the arguments yet
    first = scanner.feed('uments": {"a": "x</tool')  # in a string: not the marker, goes out at once
    assert first == [CallDelta(0, '{"a": "x</tool', scanner.calls[0]["id"], "f")]
    assert scanner.feed('_call>"} <') == [CallDelta(0, '_call>"}')]  # the value closed: the rest is not arguments
    assert scanner.feed("/tool_call> done") == [" done"]
    # An unfinished call keeps what was written; a block in another shape is parsed when it closes.
    assert split_reply_of('<tool_call>{"name": "f", "arguments": {"a": [1, ') == ("", [("f", '{"a": [1, ')], True)
    assert split_reply_of('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>') == \
        ("", [("f", '{"a": 1}')], False)
    assert split_reply_of("a <tool_call> not json </tool_call> <tool") == \
        ("a <tool_call> not json </tool_call> <tool", [], False)
    # Outside a string the close marker cannot be JSON: a malformed call ends there.
    assert split_reply_of('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>x') == \
        ("x", [("f", '{"a": 1')], False)


def split_reply_of(text: str) -> tuple[str, list[tuple[str, str]], bool]:
    from localspec.server.tools import split_reply

    content, calls, unfinished = split_reply(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], unfinished


# -- the grammar over a real vocabulary --------------------------------------------------------------------


@pytest.mark.slow
def test_grammar_mask_clone_and_accept(tiny_pair):
    with LlamaModel(tiny_pair[0], n_ctx=64, device_top_k=0, n_threads=1) as model:
        brace, word = model.tokenize("{", add_special=False), model.tokenize("hello", add_special=False)
        assert len(brace) == 1 and len(word) == 1
        g = Constraint.json_object("test").grammar(model)
        assert g.legal(np.array([brace[0], word[0], model.n_vocab + 5])).tolist() == [True, False, False]
        after = g.clone()
        after.accept(brace[0])
        assert not after.legal(np.array(brace))[0]  # "{{" is not JSON
        assert g.legal(np.array(brace))[0]  # the original state did not move
        with pytest.raises(GrammarError, match="not allowed by the grammar"):
            g.accept(word[0])
        with pytest.raises(GrammarError, match="does not parse"):
            Grammar(model, "root ::= (", "bad.gbnf")
        with pytest.raises(GrammarError, match="cannot be turned into a grammar"):
            Constraint.json_schema({"$ref": "https://example.com/schema.json"}, "schema.json").grammar(model)


@pytest.mark.slow
def test_lookup_proposals_stop_at_the_first_token_the_grammar_refuses(tiny_pair):
    """Through the seam: the lookup drafter keeps a proposal up to the first refused token and leaves the request's
    grammar copy after the kept ones (where a chained draft model continues)."""
    from localspec.drafters.base import DraftRequest
    from localspec.drafters.lookup import LookupDrafter
    from localspec.rounds.events import GenerationStats

    with LlamaModel(tiny_pair[0], n_ctx=64, device_top_k=0, n_threads=1) as model:
        (brace,), (word,) = model.tokenize("{", add_special=False), model.tokenize("hello", add_special=False)
        quote = model.tokenize('"', add_special=False)[0]
        # The context ends in `x {`, which occurred before followed by `"hello"{`: lookup proposes those four.
        x = model.tokenize(" x", add_special=False)[0]
        context = [x, brace, quote, word, quote, brace, x, brace]
        g = Constraint.json_object("test").grammar(model)
        lookup = dataclasses.replace(drafting(4, "lookup"), lookup_min=2)
        req = DraftRequest(0, context, GREEDY.sampling, lookup, GenerationStats(), g)
        unmasked = dataclasses.replace(req, grammar=None)
        assert LookupDrafter().propose(unmasked, 4).tokens == [quote, word, quote, brace]
        g.accept(brace)  # the copy as the loop hands it over: after the committed `{`
        assert LookupDrafter().propose(req, 4).tokens == [quote, word, quote]  # `{"hello"{` is not JSON
        reference = Constraint.json_object("test").grammar(model)
        for t in (brace, quote, word, quote):
            reference.accept(t)
        probe = np.arange(model.n_vocab)
        assert np.array_equal(g.legal(probe), reference.legal(probe))  # the copy advanced by the kept three


@pytest.mark.slow
def test_a_lazy_tool_grammar_waits_for_its_marker_and_never_breaks_on_it(tiny_pair):
    """Free text until `<tool_call>`; a token that would complete the marker with text the grammar forbids after
    it (`>"`) is illegal, since llama.cpp would abort replaying it; after the marker only the call may follow."""
    from localspec.server.tools import parse_tools

    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}], "auto", True)
    with LlamaModel(tiny_pair[0], n_ctx=64, device_top_k=0, n_threads=1) as model:
        g = tools.constraint().grammar(model)
        one = {text: model.tokenize(text, add_special=False) for text in ('>"', ">", "{", "hello", " Sure")}
        assert all(len(ids) == 1 for ids in one.values())
        ids = {text: ids[0] for text, ids in one.items()}
        for t in model.tokenize(" Sure, <tool_call", add_special=False):
            assert g.legal(np.array([t]))[0]
            g.accept(t)
        assert g.awaiting
        assert g.legal(np.array([ids[">"], ids['>"'], ids["hello"]])).tolist() == [True, False, True]
        g.accept(ids[">"])
        assert not g.awaiting
        assert g.legal(np.array([ids["{"], ids["hello"], ids[" Sure"]])).tolist() == [True, False, False]


@pytest.mark.slow
def test_lazy_mask_equals_the_full_mask(tiny_pair):
    """Checking a row's best tokens first keeps exactly the top tokens a full mask would keep."""
    with LlamaModel(tiny_pair[0], n_ctx=64, device_top_k=0, n_threads=1) as model:
        g = Grammar(model, LETTERS, "letters")
        rng = np.random.default_rng(3)
        full_ids = np.arange(model.n_vocab)
        legal = g.legal(full_ids)
        assert 0 < legal.sum() < model.n_vocab
        for _ in range(20):
            row = rng.normal(size=model.n_vocab).astype(np.float32)
            reference = np.where(legal, row, -np.inf)
            for need in (1, 6, 40):  # greedy, then top-k alone (no top-p or min-p cut: the top `need` legal)
                sampling = GREEDY.sampling if need == 1 else dataclasses.replace(
                    GREEDY.sampling, temperature=1.0, top_k=need, top_p=1.0, min_p=0.0)
                top = np.argsort(-reference, kind="stable")[:need]
                masked = masked_row(row, g, sampling)
                assert np.array_equal(np.argsort(-masked, kind="stable")[:need], top)
                assert np.array_equal(masked[top], row[top])
            every = dataclasses.replace(GREEDY.sampling, temperature=1.0, top_k=0)
            assert np.array_equal(masked_row(row, g, every), reference)


# -- exactness of the engine -------------------------------------------------------------------------------


@pytest.mark.slow
def test_constrained_greedy_speculative_equals_constrained_plain(tiny_pair):
    constraint = Constraint.json_schema(SCHEMA, "schema")
    with open_pair(*tiny_pair) as s:
        drafted = accepted = 0
        for seed in range(4):
            prompt = prompt_of(seed)
            plain, _, _ = run(s.engine, prompt, GREEDY.sampling, 0, 40, constraint)
            text = s.target.detokenize(plain)
            assert text.startswith("{")
            unconstrained, _, _ = run(s.engine, prompt, GREEDY.sampling, 0, 40)
            assert unconstrained != plain  # the grammar changed the output
            # Every drafter through the seam: the model's rows masked (or not), lookup cut at a refused token,
            # the chain's model continuing lookup's grammar state.
            for k, on_draft, drafter in ((1, True, "model"), (3, True, "model"), (6, True, "model"),
                                         (4, False, "model"), (4, True, "lookup"), (4, True, "chain"),
                                         (4, False, "chain")):
                spec, _, done = run(s.engine, prompt, GREEDY.sampling, k, 40, constraint, constrain_draft=on_draft,
                                    drafter=drafter)
                assert spec == plain, (seed, k, on_draft, drafter)
                drafted += done.stats.drafted
                accepted += done.stats.accepted
        assert 0 < accepted < drafted


ROW_REQUESTS = [{"prompt": prompt_of(seed), "sampling": GREEDY.sampling, "drafting": drafting(k), "max_tokens": 40}
                for seed, k in ((0, 0), (1, 4), (2, 1), (3, 6))]


def full_logits_outputs(tiny_pair, constraint: Constraint) -> list[list[int]]:
    """ROW_REQUESTS' constrained greedy outputs with device top-k off (every row copied whole: nothing shared with
    the device candidates' path)."""
    with open_pair(*tiny_pair, GREEDY.with_overrides(device_top_k=0)) as full:
        return [run(full.engine, r["prompt"], r["sampling"], r["drafting"].n_draft, r["max_tokens"], constraint)[0]
                for r in ROW_REQUESTS]


@pytest.mark.slow
def test_constrained_rows_are_full_by_default(tiny_pair):
    """With the default `[load] constrained_rows = "full"` a constrained stream turns the device sampler off on the
    target and the draft (an unconstrained one keeps it), so no row is decoded again; outputs equal the
    full-logits reference."""
    constraint = Constraint.json_schema(SCHEMA, "schema")
    expected = full_logits_outputs(tiny_pair, constraint)
    assert GREEDY.load.constrained_rows == "full"
    with open_pair(*tiny_pair) as s:
        assert s.target.device_top_k == 64 and s.engine.constrained_rows == "full"
        for r, want in zip(ROW_REQUESTS, expected, strict=True):
            run(s.engine, r["prompt"], r["sampling"], r["drafting"].n_draft, 8)
            assert s.target.device_sampler(0) == "greedy"  # unconstrained: the device's argmax (the check can fail)
            got, _, done = run(s.engine, r["prompt"], r["sampling"], r["drafting"].n_draft, r["max_tokens"],
                               constraint)
            assert got == want
            assert done.stats.full_rows == 0
            assert s.target.device_sampler(0) is None  # full logits on the target
            if r["drafting"].n_draft:  # and on the draft model where it drafts
                assert s.draft.device_sampler(0) is None


@pytest.mark.slow
def test_constrained_rows_from_device_candidates_equal_full_logits(tiny_pair):
    """With `[load] constrained_rows = "device"` the target's device top-64 serves a constrained row where it holds
    a legal token; where it holds none (the tiny model almost never ranks `{` or `"` in its top 64, so JSON needs
    the fallback often) the row is decoded again in full. Greedy output equals the full-logits path's (device
    top-k off: nothing shared) for plain and speculative decoding, alone and with another constrained stream
    beside it in a second slot."""
    from tests.helpers_rounds import run_together

    constraint = Constraint.json_schema(SCHEMA, "schema")
    device_rows = GREEDY.with_overrides(constrained_rows="device")
    requests = ROW_REQUESTS
    expected = full_logits_outputs(tiny_pair, constraint)
    with open_pair(*tiny_pair, device_rows) as s:
        assert s.target.device_top_k == 64
        redecoded = tokens = 0
        for r, want in zip(requests, expected, strict=True):
            got, _, done = run(s.engine, r["prompt"], r["sampling"], r["drafting"].n_draft, r["max_tokens"],
                               constraint)
            assert got == want, r["drafting"].n_draft
            assert json.loads(s.target.detokenize(got))
            redecoded += done.stats.full_rows
            tokens += done.stats.tokens
        assert 0 < redecoded < tokens  # both kinds of rows ran
    with open_session(ModelFiles(target=tiny_pair[0], draft=tiny_pair[1], name="test"), device_rows,
                      parallel=2) as two:
        for pair in ((0, 1), (2, 3)):
            both = [{**requests[i], "grammar": constraint.grammar(two.target)} for i in pair]
            assert run_together(two.engine, both, [0, 2]) == [expected[i] for i in pair]


@pytest.mark.slow
def test_constrained_sampling_preserves_the_constrained_target_distribution(tiny_pair):
    """The first token of a speculative round at T > 0 follows the masked, renormalised target pipeline, with the
    draft masked too (and with the draft unmasked: rejection sampling still lands on the constrained p)."""
    preset = GREEDY.with_overrides(temperature=1.5, top_k=6, top_p=1.0)
    constraint = Constraint(LETTERS, "letters")
    with open_pair(*tiny_pair, preset) as s:
        prompt = prompt_of(21)
        s.engine.reset()
        s.target.use_device_sampler(None)
        logits = s.target.decode(prompt, 0).logits[0].copy()
        everything = constraint.grammar(s.target).legal(np.arange(s.target.n_vocab))  # a full mask, no look-ahead
        p = candidates(np.where(everything, logits, -np.inf)[None, :], preset.sampling)
        s.engine.reset()
        expected = {int(t): float(q) for t, q in zip(p.ids[0], p.probs[0], strict=True) if q > 0}
        assert len(expected) == 6
        for on_draft in (True, False):
            firsts, accepted, n = Counter(), 0, 1200
            for seed in range(n):
                sampling = dataclasses.replace(preset.sampling, seed=seed)
                tokens, _, done = run(s.engine, prompt, sampling, 1, 2, constraint, constrain_draft=on_draft)
                firsts[tokens[0]] += 1
                accepted += done.stats.accepted
            assert 0 < accepted < n
            assert chi_square(firsts, expected) < 20.5  # 5 degrees of freedom, p = 0.001


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_single_token_decoding(tiny_pair, temperature):
    """Each emitted token's logprob (drafted or not) is the log-softmax of a second context's full logits,
    decoded one token at a time, at that token."""
    preset = GREEDY.with_overrides(temperature=temperature, top_k=20, top_p=1.0)
    prompt = prompt_of(5)
    with open_pair(*tiny_pair, preset) as s:
        tokens, events, done = run(s.engine, prompt, preset.sampling, 4, 30, logprobs=3)
    assert done.stats.accepted > 0 and any(not e.from_draft for e in events)
    with LlamaModel(tiny_pair[0], n_ctx=256, device_top_k=0, n_threads=1) as reference:
        reference.decode(prompt[:-1], 0)
        sequence = list(prompt)
        for i, event in enumerate(events):
            row = reference.decode([sequence[-1]], len(sequence) - 1).logits[0].astype(np.float64)
            log_probs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert abs(event.logprob - log_probs[event.token]) < 1e-6, i
            best = np.argsort(-log_probs, kind="stable")[:3]
            assert [t for t, _ in event.top_logprobs] == best.tolist()
            assert np.allclose([lp for _, lp in event.top_logprobs], log_probs[best], atol=1e-6)
            sequence.append(event.token)
    assert tokens == sequence[len(prompt):]


@pytest.mark.slow
def test_json_schema_output_of_the_chat_demo_parses(smollm2_path):
    """SmolLM2-Instruct drafting for itself (Q4_1 both): greedy JSON that the schema allows, ended by the model."""
    from localspec.sessions.chat import ChatTemplate, encode_chat

    constraint = Constraint.json_schema(SCHEMA, "schema")
    with open_pair(smollm2_path, smollm2_path) as s:
        template = ChatTemplate.for_model(s.target)
        prompt = encode_chat(s.target, template.render(
            [{"role": "user", "content": "Give the name and age of a fictional person as JSON."}]))
        tokens, _, done = run(s.engine, prompt, GREEDY.sampling, 4, 200, constraint)
        value = json.loads(s.target.detokenize(tokens))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert done.stop_reason == "eog" and done.stats.acceptance_rate > 0.9


@pytest.mark.slow
def test_a_tool_call_trigger_inside_an_accepted_draft_run(smollm2_path):
    """SmolLM2 drafting for itself accepts every draft, so the `<tool_call>` marker completes inside a draft run:
    the lazy grammar takes over mid-run in the drafts' clones and the verify rows alike, the output is the one
    constrained plain decoding gives, and the call's arguments parse."""
    from localspec.server.tools import TOOL_OPEN, parse_tools, split_reply

    tools = parse_tools([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}}], "auto", False)
    constraint = tools.constraint()
    assert constraint.trigger == TOOL_OPEN
    text = ("Question: weather in Oslo?\nAnswer: <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Oslo\"}}\n</tool_call>\nQuestion: weather in Lima?\nAnswer:")
    with open_pair(smollm2_path, smollm2_path) as s:
        prompt = s.target.tokenize(text)
        plain, _, _ = run(s.engine, prompt, GREEDY.sampling, 0, 60, constraint)
        spec, events, done = run(s.engine, prompt, GREEDY.sampling, 8, 60, constraint)
        assert spec == plain
        reply = s.target.detokenize(spec)
        content, calls, _ = split_reply(reply)
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", reply
        assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}
        # the token that completes the marker was an accepted draft with more accepted drafts after it
        seen, completes = "", None
        for i, e in enumerate(events):
            seen += e.text
            if TOOL_OPEN in seen:
                completes = i
                break
        assert completes is not None and events[completes].from_draft and events[completes + 1].from_draft
        assert done.stats.acceptance_rate > 0.9


@pytest.mark.slow
def test_generate_holds_to_a_json_schema_file_and_names_a_bad_one(demo_home, tmp_path):
    import os
    import subprocess
    import sys

    def generate(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LOCALSPEC_HOME": str(demo_home)}
        env.pop("LOCALSPEC_DEBUG", None)
        return subprocess.run([sys.executable, "-c", "from localspec.cli.app import main; main()", "generate",
                               *args], capture_output=True, text=True, env=env, timeout=600)

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    done = generate("Describe a person as JSON.", "--pair", "demo-chat", "--chat", "--temp", "0", "--threads", "1",
                    "--max-tokens", "120", "--json-schema", str(schema))
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == {"name", "age"}
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text("root ::= (")
    bad = generate("x", "--pair", "demo-chat", "--grammar", str(grammar))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"localspec: error: {grammar}: the grammar does not parse: expecting ')' at the end"]
    both = generate("x", "--json-schema", str(schema), "--grammar", str(grammar))
    assert both.returncode == 2 and "give one of them" in both.stderr
