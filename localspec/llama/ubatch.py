"""How a decode of several sequences is cut into llama.cpp ubatches: around an upstream bug, in one place.

With backend (device) sampler chains on several sequences of one context (one KV stream per sequence), rows of a
`llama_decode` that llama.cpp splits into several ubatches, or of two graphs of one size in a row with different
chains active, came back holding other rows' candidates: ggml reuses the last graph's memory plan by node index,
not by output (docs/upstream.md has the mechanism and the reproduction, bench/lab/repro_ubatch_sampler_rows.py).
Until llama.cpp fixes it, `LlamaModel` decodes so that it cannot happen:

- every `llama_decode` is exactly one ubatch (`decode_plan`, from llama.cpp's own split rule: `ubatch_split`), so
  no decode depends on how llama.cpp splits a batch and maps rows back;
- with chains attached, every call gives every chained sequence an output row (`covering_calls`), so no chain's
  output is ever freed in a graph's plan; `context_n_batch` makes llama.cpp's worst-case graph do the same;
- after a graph that left chains inactive, llama.cpp is made to plan afresh before a graph of another layout
  (`Replans`).

What this relies on in llama.cpp (split_equal's rule, the replanning call, the bug itself) is checked against the
real library by tests/test_ubatch_upstream.py, which fails when a llama.cpp update changes any of it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection, Iterable, Sequence

import llama_cpp

from localspec.llama.batch import DecodeItem, Run
from localspec.llama.recurrent import CallPlan
from localspec.rounds.scores import DeviceDist

Chunk = tuple[int, int, int]  # (item, its first token in this decode, tokens)
Trim = tuple[int, int]  # (sequence, first position to remove after the decode): padding leaves the cache again


def context_n_batch(n_batch: int, n_seq: int) -> int:
    """The n_batch (= n_ubatch) of a context of `n_seq` sequences: a multiple of n_seq, so that llama.cpp's
    worst-case graph gives every sequence's chain an output row and the memory plan it leaves behind frees no
    sampler output."""
    return -(-n_batch // n_seq) * n_seq if n_seq > 1 else n_batch


def ubatch_split(layout: Sequence[tuple[int, int]], n_ubatch: int) -> list[list[Chunk]]:
    """The ubatches llama.cpp makes of one `llama_decode` whose batch holds, in this order, `count` tokens of each
    (sequence, count) of `layout` (distinct sequences), in a context with one KV stream per sequence
    (`kv_unified = false`): `llama_batch_allocr::split_equal(n_ubatch, sequential = true)` in src/llama-batch.cpp
    of llama-cpp-python 0.3.36's llama.cpp. A ubatch takes, starting from the first sequence with tokens left,
    the sequences whose ids follow each other (id + 1) in batch order, and the same number of tokens from each
    (the fewest any has left, at most n_ubatch in all). Each ubatch: (layout index, first token, tokens) per
    sequence in it, in batch order."""
    left = [count for _, count in layout]
    done = [0] * len(layout)
    ubatches = []
    while True:
        chosen: list[int] = []
        for i, (seq, _) in enumerate(layout):
            if left[i] and (not chosen or seq == layout[chosen[-1]][0] + 1):
                chosen.append(i)
        if not chosen:
            return ubatches
        take = max(1, min(min(left[i] for i in chosen), n_ubatch // len(chosen)))
        ubatches.append([(i, done[i], take) for i in chosen])
        for i in chosen:
            left[i] -= take
            done[i] += take



def whole_plan(layout: Sequence[tuple[int, int]], n_batch: int, cells: CallPlan | None = None) -> list[list[Chunk]]:
    """`decode_plan` for a model with a recurrent state: every item's tokens in one call (an item longer than
    n_batch, a prompt, in n_batch chunks of its own), calls of sequences with consecutive ids and as many tokens
    each. llama.cpp can roll a recurrent state back only within the sequence's last ubatch (its snapshots), so a
    verify's tokens must never be split; and a ubatch of a recurrent model holds equal runs of consecutive
    sequences (`split_equal`), so each call is still exactly one ubatch.

    `cells` (a state kept with rollback snapshots): where llama.cpp holds each sequence's state. A ubatch of several
    sequences makes llama.cpp gather their states into neighbouring cells, swapping other cells out of the way
    without their snapshots, so a sequence moved that way would roll back to another cell's snapshot
    (docs/upstream.md; tests/test_hybrid.py has the canary): sequences share a call only where `cells` says it
    moves no state outside the call (`recurrent.CallPlan.shares`): a run's longest first part that does, then its
    rest the same way (one sequence alone always does)."""
    live = sorted((i for i, (_, count) in enumerate(layout) if count > 0), key=lambda i: layout[i][0])
    calls: list[list[Chunk]] = []
    group: list[int] = []  # a run: consecutive sequences, as many tokens each, within n_batch

    def call(members: list[int]) -> None:
        calls.append([(i, 0, layout[i][1]) for i in members])
        if cells is not None:
            cells.called([layout[i][0] for i in members])

    def close() -> None:
        # The run's longest first part that shares, then the rest the same way. Longest first, not grown one
        # sequence at a time: sequences in scrambled cells (slots first filled out of order) move only themselves
        # when all go together, where the first two alone would move a third out of the way, and once gathered they
        # sit in order for every later round.
        while group:
            take = len(group)
            while take > 1 and cells is not None and not cells.shares([layout[g][0] for g in group[:take]]):
                take -= 1
            call(group[:take])
            del group[:take]

    for i in live:
        seq, count = layout[i]
        if count > n_batch:
            close()
            calls.extend([[(i, first, min(n_batch, count - first))] for first in range(0, count, n_batch)])
            if cells is not None:
                cells.called([seq])
            continue
        if group and (seq != layout[group[-1]][0] + 1 or count != layout[group[-1]][1]
                      or (len(group) + 1) * count > n_batch):
            close()
        group.append(i)
    close()
    return calls


def decode_plan(layout: Sequence[tuple[int, int]], n_batch: int, streams: bool) -> list[list[Chunk]]:
    """How `LlamaModel` decodes items of (sequence, token count): a list of `llama_decode` calls, each a list of
    (item, first token, tokens). Every call is exactly one llama.cpp ubatch, so no decode depends on how
    llama.cpp splits a batch and maps rows back: with backend sampler chains on several sequences, rows of a
    decode split into several ubatches come back holding other rows' candidates (docs/upstream.md). With one KV
    stream per sequence (`streams`) the items go in ascending sequence order, which makes the fewest ubatches
    (`ubatch_split`); in a context of one sequence they go in order, n_batch tokens a call."""
    live = [i for i, (_, count) in enumerate(layout) if count > 0]
    if not streams:
        calls: list[list[Chunk]] = [[]]
        room = n_batch
        for i in live:
            done, count = 0, layout[i][1]
            while done < count:
                if room == 0:
                    calls.append([])
                    room = n_batch
                take = min(room, count - done)
                calls[-1].append((i, done, take))
                done += take
                room -= take
        return calls if calls[0] else []
    if len({layout[i][0] for i in live}) != len(live):
        raise ValueError("decode_plan: one item per sequence")
    live.sort(key=lambda i: layout[i][0])
    return [[(live[j], first, take) for j, first, take in ubatch]
            for ubatch in ubatch_split([layout[i] for i in live], n_batch)]



def plain_calls(items: Sequence[DecodeItem], n_batch: int, streams: bool, recurrent: bool = False,
                cells: CallPlan | None = None) -> list[list[Run]]:
    """`decode_plan`'s calls (`whole_plan`'s for a model with a recurrent state, sharing calls as its rollback
    snapshots' `cells` allow): each item's tokens, an output on every one of them with `all_logits`, else on its
    last."""
    calls = []
    layout = [(seq, len(tokens)) for seq, tokens, _, _ in items]
    plan = whole_plan(layout, n_batch, cells) if recurrent else decode_plan(layout, n_batch, streams)
    for chunks in plan:
        runs = []
        for item, first, take in chunks:
            seq, tokens, start_pos, all_logits = items[item]
            last = first + take == len(tokens)
            outputs = [all_logits] * take
            rows = take if all_logits else int(last)
            if last:
                outputs[-1] = True
            runs.append(Run(seq, start_pos + first, list(tokens[first : first + take]), outputs, item,
                        take - rows, rows))
        calls.append(runs)
    return calls


def covering_calls(items: Sequence[DecodeItem], chained: Collection[int], n_batch: int, cells_per_seq: int,
                   next_cell: Callable[[int], int], stand_in: int) -> tuple[list[list[Run]], list[Trim]] | None:
    """Calls in which every sequence with a device sampler chain has an output row, each call one ubatch.

    Why: llama.cpp computes every attached chain in every decode graph, on a row of its own for the sequences
    in the ubatch and on a stand-in row, whose results nobody reads, for the others. ggml then reuses the
    previous graph's memory plan for a new graph of the same size, and when the two graphs differ in which
    chains are active, an output of the new one can sit where the old plan let a later node write: rows
    come back holding other rows' candidates (docs/upstream.md). With every chain active in every graph,
    no chain's output is ever freed, so no plan can put a node over one.

    So each call holds the same number of tokens of every sequence from the lowest to the highest one that
    has a chain or an item (consecutive ids, equal lengths: one ubatch): an item's own tokens, then copies
    of its last token; a sequence without an item gets stand-in tokens after its last cell. The padding is
    computed like rejected drafts (positions after every real one, so no real row sees it) and removed
    from the caches after the decode. `chained`: the sequences with a chain; `next_cell(seq)`: the position after
    a sequence's last cell; `stand_in`: the token a sequence without an item is padded with. Returns (calls,
    [(sequence, first position to remove)]), or None when the padding does not fit (more sequences than n_batch, or
    a sequence at the end of its context)."""
    live = {seq: i for i, (seq, tokens, _, _) in enumerate(items) if len(tokens)}
    if not live:
        return [], []
    if len(live) != sum(1 for _, tokens, _, _ in items if len(tokens)):
        raise ValueError("decode_many: one item per sequence")
    seqs = set(live) | set(chained)
    lo, hi = min(seqs), max(seqs)
    span = hi - lo + 1
    length = max(len(items[i][1]) for i in live.values())
    per_call = n_batch // span
    if per_call == 0:
        return None
    starts = {}
    for seq in range(lo, hi + 1):
        start = items[live[seq]][2] if seq in live else next_cell(seq)  # (else after its last cell)
        if start + length > cells_per_seq:
            return None
        starts[seq] = start
    calls = []
    for t0 in range(0, length, per_call):
        take = min(per_call, length - t0)
        runs = []
        for seq in range(lo, hi + 1):
            if seq in live:
                item = live[seq]
                _, tokens, _, all_logits = items[item]
                real = list(tokens[t0 : t0 + take])
                outputs = [all_logits] * len(real) + [False] * (take - len(real))
                rows_at, rows = 0, (len(real) if all_logits else 0)
                if not all_logits and t0 <= len(tokens) - 1 < t0 + take:
                    rows_at, rows = len(tokens) - 1 - t0, 1
                    outputs[rows_at] = True
                padded = real + [tokens[-1]] * (take - len(real))
            else:
                item, rows_at, rows = -1, 0, 0
                outputs = [False] * take
                padded = [stand_in] * take
            if seq in chained and not any(outputs):
                outputs[-1] = True  # a row nobody reads: keeps this sequence's chain active in the graph
            runs.append(Run(seq, starts[seq] + t0, padded, outputs, item, rows_at, rows,
                            len(real) if item >= 0 else None))
        calls.append(runs)
    trims = [(seq, starts[seq] + (len(items[live[seq]][1]) if seq in live else 0))
             for seq in range(lo, hi + 1)
             if (len(items[live[seq]][1]) if seq in live else 0) < length]
    return calls, trims



class Replans:
    """Makes llama.cpp plan its graphs afresh where a reused plan could overwrite a chain's output (`before`), and
    counts how often (`count`).

    A graph where some chain runs on a stand-in row (or a sampling chain with intermediate results) leaves ggml a
    memory plan with freed sampler nodes; a next graph of the same size but another layout would reuse that plan and
    could overwrite its own outputs. Then llama.cpp is made to plan afresh before the next graph of another layout
    (a neutral control-vector call that makes it reserve its graphs again). One row alone is safe when every chain
    is the same kind (the same nodes, so both graphs' sampler nodes line up): the only node computed after that
    row's result is its own consumer, which ggml places before it frees the result."""

    def __init__(self, ctx: ctypes.c_void_p, n_embd: int, sequences: bool) -> None:
        self._ctx, self._n_embd = ctx, n_embd
        self._sequences = sequences  # a context of several sequences (with one, nothing is ever replanned)
        self._dirty: tuple[int, ...] | None = None  # the last graph's layout, if its plan had freed sampler nodes
        self.count = 0

    def before(self, chains: tuple[int, ...], modes: Iterable[str | DeviceDist]) -> bool:
        """Before a decode whose `chains` are the output rows of each chained sequence, in sequence order (0: the
        chain runs on a stand-in row), with these chains' modes. Returns whether a chain keeps intermediate
        results (a `DeviceDist`), for `after`."""
        modes = list(modes)
        dist = any(isinstance(mode, DeviceDist) for mode in modes)
        same_kind = len({mode if isinstance(mode, str) else "dist" for mode in modes}) == 1
        if (self._sequences and self._dirty is not None and chains != self._dirty
                and (sum(chains) > 1 or dist or not same_kind)):
            llama_cpp.llama_set_adapter_cvec(self._ctx, None, 0, self._n_embd, -1, -1)
            self.count += 1
        return dist

    def after(self, chains: tuple[int, ...], dist: bool) -> None:
        """After the decode (whether or not it succeeded): remember a plan that freed sampler nodes."""
        self._dirty = chains if 0 in chains or dist else None

    def forget(self) -> None:
        """The chains changed: llama.cpp plans afresh by itself (it reserves its graphs again)."""
        self._dirty = None
