"""Grammars: llama.cpp's GBNF sampler as a token mask over one model's vocabulary (eager, or lazy from a trigger), and
the GBNF of JSON (any object, or a JSON schema's, by llama-cpp-python's converter)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import GrammarError
from localspec.llama.model import LlamaModel

# llama_token_data as numpy sees it, so a whole candidate array is filled and read without per-token ctypes calls.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

def json_object_gbnf() -> str:
    """GBNF for any JSON object (OpenAI's `json_object`): llama.cpp's own json.gbnf, as llama-cpp-python ships it."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def json_schema_gbnf(schema: dict, source: str) -> str:
    """A JSON schema → GBNF, by llama-cpp-python's port of llama.cpp's json_schema_to_grammar. Schemas it cannot
    convert (a remote $ref, a malformed keyword) are a GrammarError naming `source`."""
    import json

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises bare ValueError/KeyError/TypeError on what it cannot read
        raise GrammarError(f"{source}: this JSON schema cannot be turned into a grammar: {exc}") from None


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """What C code writes to file descriptor 2 inside the block, as the list's one string (after the block)."""
    import tempfile

    said: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said.append(sink.read(4096).decode("utf-8", errors="replace"))


@dataclass(frozen=True)
class TokenPrefixes:
    """A vocabulary as a forest of text prefixes: each token's parent is the token whose text is its longest proper
    prefix (None: a root), tokens grouped by depth. llama.cpp's grammar matches a token's text character by
    character (a trailing partial UTF-8 character by the range it could still be), so a token it allows has every
    prefix allowed too: where the parent is refused, so are all its descendants. A whole-vocabulary mask then asks
    about the roots and the children of allowed tokens only: a handful of thousands where a grammar allows a few
    tokens (a literal such as `<tool_call>` or a JSON key), not every token. End-of-generation tokens (allowed
    when the grammar can end, whatever their text) and tokens without text are roots and never parents."""

    parent: np.ndarray  # int32 per token, -1 for a root
    levels: tuple[np.ndarray, ...]  # token ids by depth: roots first
    pieces: tuple[bytes, ...]  # each token's text as the grammar reads it
    _holding: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def holding(self, byte: int) -> np.ndarray:
        """Which tokens' text holds the byte (a bool per token), computed once per byte."""
        found = self._holding.get(byte)
        if found is None:
            found = self._holding[byte] = np.array([byte in piece for piece in self.pieces], dtype=bool)
        return found

    @classmethod
    def of(cls, model: LlamaModel) -> TokenPrefixes:
        found = _PREFIXES.get(model)
        if found is None:
            found = _PREFIXES[model] = cls._build(model)
        return found

    @classmethod
    def _build(cls, model: LlamaModel) -> TokenPrefixes:
        n = model.n_vocab
        # The text the grammar reads: llama.cpp's cached piece with special tokens as their text.
        pieces = [model.piece(t, special=True) for t in range(n)]
        eog = [model.is_eog(t) for t in range(n)]
        first: dict[bytes, int] = {}
        for t, piece in enumerate(pieces):
            if piece and not eog[t]:
                first.setdefault(piece, t)
        parent = np.full(n, -1, dtype=np.int32)
        depth = np.zeros(n, dtype=np.int32)
        for t in sorted(range(n), key=lambda t: len(pieces[t])):  # a parent's text is shorter: its depth is known
            piece = pieces[t]
            if eog[t] or not piece:
                continue
            for cut in range(len(piece) - 1, 0, -1):
                p = first.get(piece[:cut])
                if p is not None:
                    parent[t], depth[t] = p, depth[p] + 1
                    break
        order = np.argsort(depth, kind="stable")
        bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
        levels = tuple(order[bounds[d] : bounds[d + 1]].astype(np.int32) for d in range(len(bounds) - 1))
        return cls(parent, levels, tuple(pieces))


_PREFIXES: weakref.WeakKeyDictionary[LlamaModel, TokenPrefixes] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def matches_text_only(gbnf: str) -> bool:
    """Whether a GBNF grammar matches text only: no token references (`<[id]>`, `<|name|>`, `!<...>`), which llama.cpp
    matches by id, so a token's prefix may be refused where it is allowed. Outside comments, string literals and
    character classes `<` and `!` mean nothing else."""
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == "#":
            while i < n and gbnf[i] not in "\r\n":
                i += 1
        elif c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c in "<!":
            return False
        i += 1
    return True


class Grammar:
    """A GBNF grammar's state over one model's vocabulary (llama.cpp's grammar sampler): which tokens may come
    next (`legal`), and `accept` to advance by one token. `clone` copies the state, so a draft run can be masked
    position by position without touching the real state.

    Lazy (`trigger`, a literal marker such as `<tool_call>`): every token is legal until the emitted text holds the
    marker, and the grammar applies from the marker on (llama.cpp's lazy patterns, as llama-server does for tool
    calls). llama.cpp replays the text from the marker into the grammar when the trigger fires and aborts the
    process if that text breaks the grammar, so a token that would complete the marker with text the grammar
    forbids after it is illegal here (checked by tokenizing that text into a fresh, eager copy of the grammar)."""

    def __init__(self, model: LlamaModel, gbnf: str, source: str, *, trigger: str | None = None) -> None:
        self.model = model
        self.source = source
        self.n_vocab = model.n_vocab
        self.gbnf = gbnf
        self.trigger = trigger.encode() if trigger else None
        self.awaiting = bool(trigger)
        self._seen = b""  # while awaiting: the emitted text (bytes, as llama.cpp's trigger buffer holds it)
        self._sampler = None
        self._vocab = TokenPrefixes.of(model)
        self._by_text = matches_text_only(gbnf)
        if trigger and not all(c.isalnum() or c in "<>_/:-" for c in trigger):
            raise GrammarError(f"{source}: a trigger is letters, digits and <>_/:- only (got {trigger!r})")
        # llama.cpp's GBNF parser prints its complaint to stderr itself (fprintf): caught here, it becomes part
        # of the one-line error instead of a second message around it.
        with _stderr_captured() as said:
            if trigger:
                pattern = f"^[\\s\\S]*?({trigger})[\\s\\S]*$".encode()  # from the first match on
                patterns = (ctypes.c_char_p * 1)(pattern)
                sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                    model.vocab, gbnf.encode(), b"root", patterns, 1, None, 0)
            else:
                sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root")
        if not sampler:
            reason = said[0].strip().splitlines()[0] if said and said[0].strip() else "no `root` rule?"
            reason = reason.split("error parsing grammar: ", 1)[-1].strip()
            reason += " the end" if reason.endswith(" at") else ""  # llama.cpp quotes the rest of the text there
            raise GrammarError(f"{source}: the grammar does not parse: {reason}")
        self._sampler = sampler

    def clone(self) -> Grammar:
        twin = object.__new__(Grammar)
        twin.__dict__.update(self.__dict__)
        twin._sampler = llama_cpp.llama_sampler_clone(self._sampler)
        return twin

    def legal(self, ids: np.ndarray) -> np.ndarray:
        """Which of the token ids may come next (a bool per id). Ids outside the vocabulary never may."""
        ids = np.asarray(ids, dtype=np.int32).ravel()
        inside = (ids >= 0) & (ids < self.n_vocab)
        data = np.zeros(int(inside.sum()), dtype=_TOKEN_DATA)
        data["id"] = ids[inside]
        out = np.zeros(ids.shape, dtype=bool)
        if len(data):
            array = llama_cpp.llama_token_data_array(
                data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(data), selected=-1,
                sorted=False)
            llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
            out[inside] = np.isfinite(data["logit"])
        if self.awaiting:
            # Only a token whose text holds the marker's last byte can complete it (the text before never does).
            closing = np.zeros(ids.shape, dtype=bool)
            assert self.trigger is not None
            closing[inside] = self._vocab.holding(self.trigger[-1])[ids[inside]]
            for i in np.flatnonzero(out & closing):
                out[i] = self._trigger_is_safe(int(ids[i]))
        return out

    def legal_everywhere(self) -> np.ndarray:
        """`legal` over the whole vocabulary (a bool per token id), asking llama.cpp only about the roots of the
        vocabulary's prefix forest and the children of allowed tokens (`TokenPrefixes`); every token where the
        grammar matches tokens by id or is still awaiting its trigger."""
        if not self._by_text or self.awaiting:
            return self.legal(np.arange(self.n_vocab))
        allowed = np.zeros(self.n_vocab, dtype=bool)
        roots, *deeper = self._vocab.levels
        allowed[roots] = self.legal(roots)
        for level in deeper:
            asked = level[allowed[self._vocab.parent[level]]]  # the children of allowed tokens only
            if not len(asked):
                break
            allowed[asked] = self.legal(asked)
        return allowed

    def _trigger_is_safe(self, token: int) -> bool:
        """While awaiting: False only for a token that completes the marker with text the grammar forbids."""
        assert self.trigger is not None
        text = self._seen + self._vocab.pieces[token]  # (the grammar reads special tokens' text too)
        at = text.find(self.trigger)
        if at < 0:
            return True
        replay = text[at:].decode("utf-8", errors="ignore")
        probe = Grammar(self.model, self.gbnf, self.source)
        try:
            for t in self.model.tokenize(replay, add_special=False, parse_special=False):
                if not probe.legal(np.array([t]))[0]:
                    return False
                llama_cpp.llama_sampler_accept(probe._sampler, t)
            return True
        finally:
            probe.close()

    def accept(self, token: int) -> None:
        """Advance by one emitted token. A token the grammar forbids is refused here: llama.cpp would throw a C++
        exception through the C API (an abort)."""
        if not self.legal(np.array([token]))[0]:
            raise GrammarError(f"{self.source}: token {token} ({self.model.token_text(token)!r}) is not allowed "
                               "by the grammar here")
        if self.awaiting:
            assert self.trigger is not None
            self._seen += self._vocab.pieces[token]  # the text `legal` and the trigger check read
            if self.trigger in self._seen:
                self.awaiting, self._seen = False, b""
            else:  # only a marker's worth of tail can still become one
                self._seen = self._seen[max(0, len(self._seen) - len(self.trigger) + 1) :]
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
