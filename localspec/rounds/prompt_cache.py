"""Slot states, and the host-RAM cache of them (llama-server's `--cache-ram`): what a slot's models held, kept so
that a later request sharing a long prefix with it is restored instead of read again.

A `SlotState` is a slot's cells as llama.cpp serialises them (`llama_state_seq_get_data`), one `ModelState` per
model (the target first, then the drafter's models), each rolled back to a prefix of the same committed tokens (a
draft's cells may hold drafted tokens past them; those are dropped). What a restored state may serve depends on
the model, and `ModelState.floor` says it: the shortest length its cells may be cut back to and still hold what a
fresh decode of that prefix would.
- A KV cache of full attention keeps each position's keys and values for themselves: any prefix is valid (floor 0).
- Sliding-window attention (Gemma 3): llama.cpp saves only the window's last positions of those layers, so after a
  restore the cells before them are missing; the state is valid only cut back by at most one token.
- A recurrent or hybrid model's state (Mamba, Gated DeltaNet) is a running summary of every token before it:
  valid at exactly its length and at no prefix of it (floor = its length).
`SlotState.reusable` applies that rule, the one place it is written: the engine restores a state only where it
serves at least that many tokens, and the model's own `truncate` cuts the rest.

`PromptCache` keeps states within a byte budget, the least recently used leaving first (llama-server's order); a
state larger than the whole budget is not kept, one that an entry already serves (its tokens a prefix of that
entry's, on models whose prefixes are valid) is not kept twice, and a new state replaces the entries it serves.
An entry stays cached when it is restored (a restore copies it into the slot), so a conversation that two slots
pass back and forth is never lost to one of them.

The byte budget is a `CacheBudget`, one per process: a cache made with a limit has one of its own; the caches of
the pairs `serve --pair A --pair B` has loaded share one (the router's), the least recently used state of any of
them leaving first, so several pairs never hold more than one `cache_ram` together. Each cache looks up only its
own states (another pair's cells mean nothing to its models) and `clear` returns its share when its pair unloads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# `[server] cache_ram = "auto"`: this share of the RAM available when the server starts. llama-server's default is
# a fixed 8 GiB; a share keeps a small machine usable and lets a large one keep many conversations.
AUTO_SHARE = 0.25
MIB = 1 << 20
# An entry is restored only for at least this share of what it holds (llama-server's f_keep >= 0.25): copying a
# long conversation's state in to reuse its first tokens (a BOS, a common system prompt) costs more than it saves.
KEEP_SHARE = 0.25


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (what a KV cache holding `a` can keep of `b`), never ending
    inside a picture of `b` (`picture_boundary`)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return picture_boundary(b, n)


def picture_boundary(tokens: Sequence[int], n: int) -> int:
    """`n`, or less where tokens[:n] would end inside a run of a picture's placeholder ids (negative:
    llama.vision): a picture is decoded whole or not at all, so a kept prefix stops before the run."""
    while 0 < n < len(tokens) and tokens[n] < 0 and tokens[n - 1] < 0:
        n -= 1
    return n


def auto_limit(ram_available: int) -> int:
    """The cache's byte budget for `cache_ram = "auto"`: a quarter of the RAM available now."""
    return int(max(0, ram_available) * AUTO_SHARE)


def limit_bytes(cache_ram: str, ram_available: int) -> int:
    """`[server] cache_ram` as bytes: "auto", or whole MiB ("0": no cache). The preset checked the form."""
    return auto_limit(ram_available) if cache_ram == "auto" else int(cache_ram) * MIB


@dataclass(eq=False)
class ModelState:
    """One model's cells of a slot: the first `n_tokens` of the slot's tokens, as llama.cpp serialised them."""

    n_tokens: int
    data: bytearray  # llama.cpp's sequence state (opaque here)
    floor: int = 0  # restored, the cells are valid cut back to any length in floor..n_tokens (module docstring)

    def reusable(self, tokens: Sequence[int], body: Sequence[int]) -> int:
        """How many leading tokens of `body` this state holds once restored and cut back (0: none)."""
        n = min(self.n_tokens, shared_prefix(tokens[: self.n_tokens], body))
        return n if n >= self.floor else 0


@dataclass(frozen=True)
class SeqFile:
    """A drafter's part of a slot state as a slot file holds it: the drafter it belongs to (`Drafter.seq_kind`), its
    fields (JSON) and its byte blobs (`SeqState.to_file`; `Drafter.seq_from_file` checks and reads it back)."""

    kind: str
    meta: dict[str, Any]
    blobs: tuple[bytearray, ...]

    def count(self, name: str, most: int) -> int:
        """Field `name` as a count 0..most (a file's fields are checked before use: ValueError naming it)."""
        value = self.meta.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
            raise ValueError(f"{name} is {value!r}, not a count up to {most}")
        return value

    def ints(self, i: int) -> list[int]:
        """Blob `i` as token ids (`ints_blob`'s)."""
        return np.frombuffer(bytes(self.blobs[i]), dtype="<i4").tolist()

    def rows(self, i: int, n: int, width: int) -> list[np.ndarray]:
        """Blob `i` as `n` float32 rows of `width` (`rows_blob`'s), each an array of its own."""
        return list(np.frombuffer(bytes(self.blobs[i]), dtype="<f4").reshape(n, width).copy())


def ints_blob(ids: Sequence[int]) -> bytearray:
    """Token ids as a slot file keeps them (little-endian int32)."""
    return bytearray(np.asarray(ids, dtype="<i4").tobytes())


def rows_blob(rows: Sequence[np.ndarray]) -> bytearray:
    """Hidden rows as a slot file keeps them (little-endian float32, row after row)."""
    return bytearray(np.stack(rows).astype("<f4").tobytes()) if len(rows) else bytearray()


class SeqState(Protocol):
    """A drafter's part of a slot's state beyond its models' cells (`Drafter.save_seq`: an MTP head's cells and the
    target rows it holds), opaque here but for its size, which the cache's budget counts, and its file form."""

    @property
    def nbytes(self) -> int: ...

    def to_file(self) -> SeqFile: ...


@dataclass(eq=False)
class SlotState:
    """A slot's models' cells: `tokens` is what the most complete of them holds; each model holds a prefix. With
    `drafters`, each engine drafter's own part (`Drafter.save_seq`, in the engine's order; None: it keeps nothing);
    empty: the state has none (a slot file), and every drafter forgets the slot on restore."""

    tokens: tuple[int, ...]
    models: tuple[ModelState, ...]  # the engine's models in its order: the target first
    drafters: tuple[SeqState | None, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(len(m.data) for m in self.models) + sum(d.nbytes for d in self.drafters if d is not None)

    def reusable(self, body: Sequence[int]) -> int:
        """How many of `body`'s leading tokens the target need not decode after this state is restored."""
        return self.models[0].reusable(self.tokens, body) if self.models else 0

    def covers(self, other: SlotState) -> bool:
        """Whether this state serves every prompt `other` serves, and as far: each model holds at least as much of
        the same tokens, and a model whose prefixes are not all valid holds exactly as much."""
        if len(self.models) != len(other.models):
            return False
        mine_kept = [d is not None for d in self.drafters]
        if any(d is not None and (i >= len(mine_kept) or not mine_kept[i]) for i, d in enumerate(other.drafters)):
            return False  # (it keeps a drafter's part, an MTP head's, that this one lacks: a hit there reads less)
        for mine, theirs in zip(self.models, other.models, strict=True):
            if (mine.floor or theirs.floor) and (mine.n_tokens, mine.floor) != (theirs.n_tokens, theirs.floor):
                return False
            if mine.n_tokens < theirs.n_tokens:
                return False
        held = max((m.n_tokens for m in other.models), default=0)
        return len(self.tokens) >= held and self.tokens[:held] == other.tokens[:held]


@dataclass(frozen=True)
class CacheCounters:
    """What /metrics reports: lookups that restored a state (hits) or found none that helps (misses), and what the
    cache holds."""

    hits: int
    misses: int
    stored: int  # states kept
    evicted: int  # ... removed to make room within the budget
    skipped: int  # states larger than the whole budget, not kept
    restored_tokens: int  # prompt tokens restored instead of decoded, over all hits
    entries: int
    tokens: int
    nbytes: int
    limit: int  # the budget's bytes (shared with the other pairs' caches where several are served)
    shared_bytes: int  # what every cache of the budget holds together (this one's `nbytes` where it is alone)


class CacheBudget:
    """The host RAM the prompt caches drawing on it may take together (module docstring): their states in one
    least-recently-used order, under one lock."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.lock = threading.Lock()
        self.entries: list[tuple[PromptCache, SlotState]] = []  # least recently used first, every cache's
        self.nbytes = 0

    def used(self) -> int:
        with self.lock:
            return self.nbytes


class PromptCache:
    """Slot states in host RAM within `limit` bytes, or within a `CacheBudget` shared with other caches (module
    docstring). The engine thread stores and looks up; other threads read `counters()`."""

    def __init__(self, limit: int = 0, budget: CacheBudget | None = None) -> None:
        self.budget = budget if budget is not None else CacheBudget(limit)
        self._lock = self.budget.lock
        self._hits = self._misses = self._stored = self._evicted = self._skipped = self._restored = 0

    @property
    def limit(self) -> int:
        return self.budget.limit

    def _own(self) -> list[SlotState]:
        """This cache's states, least recently used first (called holding the lock)."""
        return [s for owner, s in self.budget.entries if owner is self]

    def _drop(self, state: SlotState) -> None:
        """Take `state` out of the budget (called holding the lock)."""
        self.budget.entries = [(o, s) for o, s in self.budget.entries if s is not state]
        self.budget.nbytes -= state.nbytes

    def _touch(self, state: SlotState) -> None:
        """Make `state` the most recently used of the budget (called holding the lock)."""
        self.budget.entries = [(o, s) for o, s in self.budget.entries if s is not state] + [(self, state)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._own())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._own())

    def put(self, state: SlotState) -> bool:
        """Keep `state` (True), unless it holds nothing, is larger than the budget, or an entry serves all it
        does (that entry becomes the most recently used). Entries it serves leave; then the least recently used
        of the budget (any cache's) until it fits."""
        if not state.models or state.models[0].n_tokens == 0:
            return False
        with self._lock:
            if state.nbytes > self.budget.limit:
                self._skipped += 1
                return False
            own = self._own()
            for entry in own:
                if entry.covers(state):
                    self._touch(entry)
                    return False
            for entry in own:
                if state.covers(entry):
                    self._drop(entry)
            while self.budget.entries and self.budget.nbytes + state.nbytes > self.budget.limit:
                owner, oldest = self.budget.entries[0]
                self._drop(oldest)
                owner._evicted += 1
            self.budget.entries.append((self, state))
            self.budget.nbytes += state.nbytes
            self._stored += 1
            return True

    def best(self, body: Sequence[int], better_than: int = 0) -> tuple[SlotState, int] | None:
        """The entry that serves most of `body` (the most recently used on a tie), if it serves more than
        `better_than` tokens (what the slot holds already) and at least a quarter of what it holds (`KEEP_SHARE`),
        with how many; it becomes the most recently used.
        Counts a hit, or a miss when none does."""
        with self._lock:
            found, reuse = None, better_than
            for entry in reversed(self._own()):
                n = entry.reusable(body)
                if n > reuse and n >= KEEP_SHARE * entry.models[0].n_tokens:
                    found, reuse = entry, n
            if found is None:
                self._misses += 1
                return None
            self._touch(found)
            self._hits += 1
            self._restored += reuse
            return found, reuse

    def clear(self) -> None:
        """Forget this cache's states (its pair unloads: their bytes go back to the budget)."""
        with self._lock:
            for entry in self._own():
                self._drop(entry)

    def counters(self) -> CacheCounters:
        with self._lock:
            own = self._own()
            return CacheCounters(hits=self._hits, misses=self._misses, stored=self._stored, evicted=self._evicted,
                                 skipped=self._skipped, restored_tokens=self._restored, entries=len(own),
                                 tokens=sum(len(e.tokens) for e in own), nbytes=sum(e.nbytes for e in own),
                                 limit=self.budget.limit, shared_bytes=self.budget.nbytes)
