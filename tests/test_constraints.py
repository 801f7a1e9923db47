"""Constrained generation and logprobs through the real llama.cpp: the grammar mask, greedy identity of constrained
plain and speculative decoding, the constrained target's distribution at T > 0, logprobs against a second context
decoding one token at a time, and the server's response_format / grammar / logprobs fields."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from localspec.config import Drafting, load_preset
from localspec.constraints import Constraint, masked_row
from localspec.engine import DoneEvent, TokenEvent
from localspec.errors import GrammarError
from localspec.llama_ctx import Grammar, LlamaModel
from localspec.sampling import candidates
from localspec.server.schema import RequestError
from localspec.server.structured import chat_logprobs, completion_logprobs, request_constraint
from localspec.session import ModelFiles, open_session
from tests.helpers_stats import chi_square

GREEDY = load_preset("greedy").with_overrides(threads=1)  # one thread: a busy box stalls llama.cpp's spinning pool
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
    with pytest.raises(RequestError) as info:
        request_constraint(response_format, grammar)
    assert info.value.param == param and needle in info.value.message


def test_logprobs_fields():
    assert chat_logprobs(None, None) is None and chat_logprobs(False, None) is None
    assert chat_logprobs(True, None) == 0 and chat_logprobs(True, 5) == 5
    assert completion_logprobs(3) == 3 and completion_logprobs(None) is None
    for bad in ((1, None), (True, 21), (False, 2), (True, "2")):
        with pytest.raises(RequestError):
            chat_logprobs(*bad)
    with pytest.raises(RequestError, match="0..5"):
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
    from localspec.server.tools import ToolError, parse_tools

    with pytest.raises(ToolError) as info:
        parse_tools(tools, choice, parallel)
    assert info.value.param == param


def test_tool_calls_are_split_from_the_text_however_it_arrives():
    from localspec.server.tools import ToolScanner, split_reply

    reply = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = split_reply(reply)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    for size in (1, 3, 7):
        scanner, sent = ToolScanner(), ""
        for i in range(0, len(reply), size):
            sent += scanner.feed(reply[i : i + size])
        sent += scanner.flush()
        assert sent.strip() == content and [c["function"] for c in scanner.calls] == [c["function"] for c in calls]
    assert split_reply("a <tool_call> not json </tool_call> <tool") == ("a <tool_call> not json </tool_call> <tool",
                                                                          [])


# -- the grammar over a real vocabulary --------------------------------------------------------------------


@pytest.mark.slow
def test_grammar_mask_clone_and_accept(tiny_pair):
    with LlamaModel(tiny_pair[0], n_ctx=64, n_threads=1) as model:
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
    from localspec.events import GenerationStats

    with LlamaModel(tiny_pair[0], n_ctx=64, n_threads=1) as model:
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
    with LlamaModel(tiny_pair[0], n_ctx=64, n_threads=1) as model:
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
    with LlamaModel(tiny_pair[0], n_ctx=64, n_threads=1) as model:
        g = Grammar(model, LETTERS, "letters")
        rng = np.random.default_rng(3)
        full_ids = np.arange(model.n_vocab)
        legal = g.legal(full_ids)
        assert 0 < legal.sum() < model.n_vocab
        for _ in range(20):
            row = rng.normal(size=model.n_vocab).astype(np.float32)
            reference = np.where(legal, row, -np.inf)
            for need in (1, 6, 40):
                top = np.argsort(-reference, kind="stable")[:need]
                masked = masked_row(row, g, need)
                assert np.array_equal(np.argsort(-masked, kind="stable")[:need], top)
                assert np.array_equal(masked[top], row[top])
            assert np.array_equal(masked_row(row, g, 0), reference)


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
    with LlamaModel(tiny_pair[0], n_ctx=256, n_threads=1) as reference:
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
    from localspec.chat import ChatTemplate, encode_chat

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
        content, calls = split_reply(reply)
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
