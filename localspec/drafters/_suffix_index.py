"""The suffix drafter's index: the earlier occurrences of the end of a request's context, in the context itself and in
past requests' text of the same owner, and what followed there, counted.

A `TokenStream` holds documents' token ids one after another (`SEPARATOR` between them), at absolute positions (a
stream that dropped its oldest tokens keeps the others' positions), and for every position the hash of the ANCHOR
tokens ending there (the anchor n-gram) → its latest `candidates` end positions. A query (`best_continuation`) looks
the query's last ANCHOR tokens up in each stream, measures how deep each occurrence matches the query's end (up to
`depth` tokens, by slice comparisons: a binary search in C), keeps the deepest ones — the occurrences of the longest
matched suffix, the node of a suffix tree SuffixDecoding (arXiv 2411.04975) speculates from — and walks their
continuations token by token: the most frequent next token among the occurrences still on the path, while the
path's estimated probability (the product of each step's share) stays at or above `min_prob` and for at most
`factor` x the match depth tokens (a deep match speculates long, a shallow one short).

Bounded by construction: a stream's entries are at most one a position and `candidates` an anchor; a `Corpus` (one
owner's past documents) and the `SuffixStore` of every owner keep at most `budget` tokens, the oldest documents out
first; a request's context stream keeps a window of its latest tokens. An append indexes each new token once (a
dict update), a query costs at most `candidates` x log2(`depth`) slice comparisons of at most `depth` tokens plus
`candidates` per proposed token, whatever the text's length or repetitiveness; `work` counts those steps (tests
check work, not wall time).

Hand-written: no kept library offers a bounded, incremental suffix structure over token ids with eviction (suffix
array and suffix automaton packages build once over a fixed text, over characters or bytes; SuffixDecoding's own
tree is C++ inside ArcticInference's vLLM plugin). A suffix automaton cannot forget its oldest text; a hashed
anchor → latest positions table can, one document at a time, which is what a budget with eviction needs.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SEPARATOR = -1  # between a corpus's documents: no token id equals it, so no match or continuation crosses it
ANCHOR = 3  # tokens of the query's end looked up (a match is at least this deep)
CANDIDATES = 64  # latest occurrences kept per anchor and stream (older ones are forgotten)

Entry = int | list[int]  # one end position, or several (ascending)


class TokenStream:
    """Token ids at absolute positions base.. (documents separated by SEPARATOR) and, for every position from
    `floor` on up to `indexed`, its anchor n-gram's hash → the latest end positions (ascending, at most `candidates`).

    Appending (`append`) and indexing (`index_to`) are apart, so a request's context can hold its last token
    before the anchors that end there are in (a match must have occurred before the query's end). The oldest
    tokens go with `drop_front`, the newest with `truncate`; each removes exactly its positions' entries."""

    __slots__ = ("anchor", "candidates", "tokens", "base", "indexed", "floor", "work", "_anchors")

    def __init__(self, anchor: int = ANCHOR, candidates: int = CANDIDATES) -> None:
        self.anchor, self.candidates = anchor, candidates
        self.tokens = array("i")
        self.base = 0  # the absolute position of tokens[0]
        self.indexed = 0  # anchors ending before this absolute position are in
        self.floor = 0  # no anchor starts before this position (the start of the document being indexed)
        self.work = 0  # elementary steps done (entries touched, tokens compared): what tests bound
        self._anchors: dict[int, Entry] = {}

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def entries(self) -> tuple[int, int]:
        """(anchor keys, end positions held): what the index's memory grows with."""
        return len(self._anchors), sum(1 if type(e) is int else len(e) for e in self._anchors.values())

    def token(self, pos: int) -> int | None:
        """The token at absolute position `pos`; None past the end or before the base."""
        i = pos - self.base
        return self.tokens[i] if 0 <= i < len(self.tokens) else None

    def append(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def start_document(self) -> None:
        """What is appended from here on is a new document: a separator first, and no anchor reaches back over it."""
        if self.tokens:
            self.tokens.append(SEPARATOR)
        self.floor = self.indexed = self.end

    def _grams(self, first: int, stop: int) -> Iterable[tuple[int, int]]:
        """(hash of the anchor n-gram ending at e, e) for e in first..stop-1 (absolute; built in C by zipping
        shifted slices)."""
        n, offset = self.anchor, self.base
        lo, hi = first - offset, stop - offset
        grams = zip(*(self.tokens[lo - n + 1 + i : hi - n + 1 + i] for i in range(n)), strict=True)
        return zip(map(hash, grams), range(first, stop), strict=True)

    def index_to(self, stop: int) -> None:
        """Index the anchors ending at positions up to `stop` - 1 (at most the stream's end)."""
        stop = min(stop, self.end)
        first = max(self.indexed, self.floor + self.anchor - 1, self.base + self.anchor - 1)
        if first >= stop:
            self.indexed = max(self.indexed, stop)
            return
        anchors, cap = self._anchors, self.candidates
        for key, end in self._grams(first, stop):
            held = anchors.get(key)
            if held is None:
                anchors[key] = end
            elif type(held) is int:
                anchors[key] = [held, end]
            else:
                held.append(end)
                if len(held) > cap:
                    del held[0]
        self.work += stop - first
        self.indexed = stop

    def drop_front(self, new_base: int) -> None:
        """Forget the positions before `new_base` (the oldest documents, a context's oldest tokens)."""
        new_base = min(new_base, self.end)
        if new_base <= self.base:
            return
        # The anchors ending before new_base, and those after it that reach back before it (kept, they would
        # never match: their first tokens are gone; and never removed by a later drop, which starts past them).
        first = self.base + self.anchor - 1
        stop = min(new_base + self.anchor - 1, self.indexed)
        if first < stop:
            anchors = self._anchors
            for key, end in self._grams(first, stop):
                held = anchors.get(key)
                if held == end:
                    del anchors[key]
                elif type(held) is list and held[0] == end:  # (else the cap pushed it out already)
                    del held[0]
                    if len(held) == 1:
                        anchors[key] = held[0]
            self.work += stop - first
        del self.tokens[: new_base - self.base]
        self.base = new_base
        self.indexed = max(self.indexed, new_base)
        self.floor = max(self.floor, new_base)

    def unindex(self, stop: int) -> None:
        """Forget the anchors ending at `stop` and after (their tokens stay)."""
        first = max(stop, self.base + self.anchor - 1, self.floor + self.anchor - 1)
        if first < self.indexed:
            anchors = self._anchors
            for key, at in reversed(list(self._grams(first, self.indexed))):
                held = anchors.get(key)
                if held == at:
                    del anchors[key]
                elif type(held) is list and held[-1] == at:
                    held.pop()
                    if len(held) == 1:
                        anchors[key] = held[0]
            self.work += self.indexed - first
        self.indexed = max(min(self.indexed, stop), self.base)

    def truncate(self, end: int) -> None:
        """Forget the positions from `end` on."""
        end = max(end, self.base)
        if end >= self.end:
            return
        self.unindex(end)
        del self.tokens[end - self.base :]
        self.floor = min(self.floor, end)

    def occurrences(self, gram: Sequence[int]) -> list[int]:
        """The end positions held for the anchor n-gram `gram` (a hash collision's too: callers compare tokens)."""
        held = self._anchors.get(hash(tuple(gram)))
        if held is None:
            return []
        return [held] if type(held) is int else list(held)

    def depth(self, end: int, query: array, limit: int) -> int:
        """How many tokens ending at absolute position `end` equal the query's last ones, at most `limit` (and at
        most the stream's tokens back to its base): the longest l whose slices match, by binary search (a match of
        l tokens is one of every shorter length)."""
        i = end - self.base + 1  # tokens[..i] end at `end`
        most = min(limit, i, len(query))
        size = len(query)

        def matches(n: int) -> bool:
            self.work += n
            return self.tokens[i - n : i] == query[size - n :]

        if most <= 0:
            return 0
        if matches(most):
            return most
        low, high = 0, most - 1  # low matches (0 always does), most does not
        while low < high:
            mid = (low + high + 1) // 2
            if matches(mid):
                low = mid
            else:
                high = mid - 1
        return low


@dataclass(frozen=True, slots=True)
class Continuation:
    """A query's answer: the deepest match's depth (0: none), how many occurrences matched that deep, the first
    step's next-token counts among them, and the proposed tokens with the path's estimated probability after
    each (the product of each step's share of the occurrences still on the path)."""

    depth: int = 0
    support: int = 0
    counts: dict[int, int] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    probability: list[float] = field(default_factory=list)


NO_MATCH = Continuation()


def best_continuation(streams: Sequence[TokenStream], query: Sequence[int], k: int, *, depth: int,
                      factor: float, min_prob: float, follows_query: TokenStream | None = None) -> Continuation:
    """The most frequent continuation of the deepest occurrences of the query's end in `streams` (earlier ones
    older: the later stream's and position's token wins a tie), at most k tokens and `factor` x the match depth,
    stopped where the path's estimated probability falls below `min_prob`.

    `follows_query`: the stream that holds the query itself (a request's context, its last token the query's): an
    occurrence there whose continuation reaches the query's end goes on with the proposed tokens, as the text would
    if it repeats with that period (a run of one token continues as that token)."""
    anchor = streams[0].anchor if streams else ANCHOR
    if k <= 0 or len(query) < anchor:
        return NO_MATCH
    tail = array("i", query[-depth:])
    gram = tail[-anchor:]
    found: list[tuple[int, int, int]] = []  # (depth, stream's rank, end position)
    for rank, stream in enumerate(streams):
        for end in stream.occurrences(gram):
            matched = stream.depth(end, tail, depth)
            if matched >= anchor:
                found.append((matched, rank, end))
    if not found:
        return NO_MATCH
    deepest = max(m for m, _, _ in found)
    # Oldest first: a tie between next tokens goes to the latest occurrence that proposes it.
    on_path = sorted((rank, end) for m, rank, end in found if m == deepest)
    limit = min(k, max(1, int(factor * deepest)))
    tokens: list[int] = []
    probability: list[float] = []
    first_counts: dict[int, int] = {}
    path_p = 1.0
    for step in range(limit):
        votes: Counter[int] = Counter()
        latest: dict[int, int] = {}  # token → the index in on_path of its latest occurrence
        nexts: list[int | None] = []
        for i, (rank, end) in enumerate(on_path):
            stream = streams[rank]
            stream.work += 1
            pos = end + 1 + step
            token = stream.token(pos)
            if token is None and stream is follows_query and pos >= stream.end:
                token = tokens[pos - stream.end]  # (pos - end < step + 1: proposed already)
            if token is None or token == SEPARATOR:
                nexts.append(None)
                continue
            nexts.append(token)
            votes[token] += 1
            latest[token] = i
        if not votes:
            break
        if step == 0:
            first_counts = dict(votes)
        best = max(votes, key=lambda t: (votes[t], latest[t]))
        path_p *= votes[best] / sum(votes.values())
        if path_p < min_prob:
            break
        tokens.append(best)
        probability.append(path_p)
        on_path = [c for c, t in zip(on_path, nexts, strict=True) if t == best]
    return Continuation(deepest, len([m for m, _, _ in found if m == deepest]), first_counts, tokens, probability)


class ContextStream(TokenStream):
    """A request's committed tokens (prompt, then reply) as one document: the latest `window` of them at their
    positions in the request, anchors indexed up to the token before the last (`sync`)."""

    __slots__ = ("window",)

    def __init__(self, tokens: Sequence[int], window: int, anchor: int = ANCHOR,
                 candidates: int = CANDIDATES) -> None:
        super().__init__(anchor, candidates)
        self.window = max(window, 1)
        start = max(0, len(tokens) - self.window)
        self.base = self.indexed = self.floor = start
        self.append(tokens[start:])

    def sync(self, tokens: Sequence[int], index: bool) -> None:
        """Follow the request's committed tokens (which only grow, but for a reply that ends inside a round: cut
        back to there); with `index`, the anchors that end before its last token. The window slides by half of it
        at a time (amortised: each token dropped once)."""
        size = len(tokens)
        if size < self.end:
            self.truncate(size)
            self.unindex(size - 1)  # (the last token's anchor is the query's, not a match)
        elif size - self.end > self.window:  # a jump past the window: start over at its latest tokens
            self.drop_front(self.end)
            self.base = self.indexed = self.floor = size - self.window
            self.append(tokens[self.base :])
        elif size > self.end:
            self.append(tokens[self.end :])
        if len(self.tokens) > 2 * self.window:
            self.drop_front(self.end - self.window)
        if index:
            self.index_to(size - 1)


@dataclass(slots=True)
class Corpus:
    """One owner's past documents in one stream, oldest first: (serial, start, end) each."""

    stream: TokenStream
    documents: deque[tuple[int, int, int]] = field(default_factory=deque)
    tokens: int = 0  # the documents' tokens (separators not counted)


class SuffixStore:
    """Past documents (requests' prompts and replies) per owner, at most `budget` tokens in all: the oldest
    document out first, whoever owns it. An owner's documents are only ever searched for that owner's requests
    (`corpus`). A document that extends its owner's latest one (the next turn of a conversation: the same history
    and more) replaces it rather than holding its text twice."""

    def __init__(self, budget: int, anchor: int = ANCHOR, candidates: int = CANDIDATES) -> None:
        self.budget = budget
        self.anchor, self.candidates = anchor, candidates
        self._corpora: dict[str, Corpus] = {}
        self._order: OrderedDict[int, str] = OrderedDict()  # serial → owner, oldest first
        self._serial = 0
        self.tokens = 0

    def owners(self) -> list[str]:
        return list(self._corpora)

    def corpus(self, owner: str) -> Corpus | None:
        return self._corpora.get(owner)

    def documents(self, owner: str) -> list[list[int]]:
        """The owner's documents' tokens, oldest first (tests, reports)."""
        corpus = self._corpora.get(owner)
        if corpus is None:
            return []
        s = corpus.stream
        return [s.tokens[start - s.base : end - s.base].tolist() for _, start, end in corpus.documents]

    def add(self, owner: str, tokens: Sequence[int]) -> None:
        """Keep a finished document of `owner` (its latest `budget` tokens), then evict down to the budget."""
        if self.budget <= 0 or len(tokens) < self.anchor:
            return
        doc = array("i", tokens[-self.budget :])
        corpus = self._corpora.get(owner)
        if corpus is None:
            corpus = self._corpora[owner] = Corpus(TokenStream(self.anchor, self.candidates))
        stream = corpus.stream
        if corpus.documents:
            serial, start, end = corpus.documents[-1]
            if end - start <= len(doc) and stream.tokens[start - stream.base : end - stream.base] == doc[: end - start]:
                corpus.documents.pop()  # it extends the latest: that one goes (its separator too)
                del self._order[serial]
                stream.truncate(start - 1 if start > stream.base else start)
                corpus.tokens -= end - start
                self.tokens -= end - start
        stream.start_document()
        start = stream.end
        stream.append(doc)
        stream.index_to(stream.end)
        self._serial += 1
        corpus.documents.append((self._serial, start, stream.end))
        corpus.tokens += len(doc)
        self.tokens += len(doc)
        self._order[self._serial] = owner
        self.evict()

    def evict(self) -> None:
        """The oldest documents out until the budget holds."""
        while self.tokens > self.budget and self._order:
            serial, owner = self._order.popitem(last=False)
            corpus = self._corpora[owner]
            assert corpus.documents[0][0] == serial  # (an owner's documents are in the order's order)
            _, start, end = corpus.documents.popleft()
            corpus.tokens -= end - start
            self.tokens -= end - start
            if not corpus.documents:
                del self._corpora[owner]
            else:
                corpus.stream.drop_front(corpus.documents[0][1])

    def clear(self) -> None:
        self._corpora.clear()
        self._order.clear()
        self.tokens = 0
