"""The MTP drafter: the target's own multi-token-prediction head (Qwen3.5/3.6's NextN block) drafts, no draft model.

The head (`llama.mtp_head.MtpHead`, a context of its own over the target's weights) reads, at position p, the token x_p
and the target's hidden state after x_{p-1}, and scores x_{p+1}. So it follows the target: every target decode of
its streams returns the hidden state after each token (`Scores.hidden`, handed over through `target_rows`), and
the head decodes the committed tokens paired with them, lazily, in the first decode of the next draft (which also
scores the draft's first token). Its later steps feed it the token it just drafted and its own hidden state there
(chained drafts, as llama.cpp's draft-mtp does); those positions leave its cells after drafting, and the verify's
rows replace them with the target's. Drafts are the head's argmax at T = 0 and samples from its distribution
(under the request's sampling, with a random stream of its own) at T > 0, with q as usual; with one slot on a GPU
the head's rows are the device's argmax or top candidates where the sampling allows (`device_mode`, as the draft
model's).

Per sequence it keeps its cells' tokens (positions [0, m)), and the target's hidden rows from position m - 1 to
where the target's cells end: a new prompt that shares a prefix keeps what still matches, and asks the loop to
decode the target again from where its rows end (`target_limit`). A head that sits rounds out (k = 0: adaptive k
judged it a loss) would keep a row per token until it drafts again; past `ROWS_HELD` rows it reads them (one head
decode, as a prompt's rows are read), so what it keeps stays bounded whatever the context.

Its prices (`MtpCost`): a head step is a draft step, each of its tokens right at the head's own measured rate, so
the draft model's rule prices it (`model.ModelCost`) under a source of its own; no draft-ahead (`draft_ahead` does
nothing).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from localspec.config import Drafting
from localspec.drafters.base import (
    NO_PROPOSAL,
    Drafter,
    DrafterBase,
    DraftRequest,
    PromptWork,
    Proposal,
    Spent,
    device_mode,
    row_draft,
    shared_prefix,
)
from localspec.drafters.model import ModelCost
from localspec.errors import DecodeError, UsageError
from localspec.rounds.policies import DraftCost
from localspec.rounds.prompt_cache import SeqFile, SeqState, ints_blob, rows_blob
from localspec.rounds.sampling import Candidates
from localspec.rounds.scores import ScoringModel

MTP_BATCH = 64  # entries per head decode: its compute buffer holds this many rows of logits (memory.py)
ROWS_HELD = MTP_BATCH  # the target rows a sequence keeps for a head sitting rounds out before it reads them
LLAMA_SERVER_TYPE = "draft-mtp"  # its `speculative.type` (llama-server's name)


class MtpCost(ModelCost):
    """The head's prices: the draft model's rule (a token a step, acceptance per position, probed when judged a
    loss) over the head's own acceptance and steps."""

    SOURCE = "mtp"


@dataclass(eq=False)
class _Seq:
    """One sequence: the head's cells and the target's hidden rows it has not consumed yet."""

    tokens: list[int] = field(default_factory=list)  # x_p of the head's cells, positions [0, len)
    seen: list[int] = field(default_factory=list)  # the target's cells' tokens when its rows were taken
    rows: list[np.ndarray] = field(default_factory=list)  # target hidden rows, positions [rows_from, rows_to)
    rows_from: int = 0
    # Where the last prompt ended (the target's cells then, where a recurrent target checkpoints) and the target's
    # row before it: a next prompt that shares that prompt starts the head there with no target row decoded again.
    anchor: tuple[int, np.ndarray] | None = None

    @property
    def rows_to(self) -> int:
        return self.rows_from + len(self.rows)


MTP_KIND = "mtp"  # its parts in slot files


def _copy(st: _Seq) -> _Seq:
    """A sequence's bookkeeping with lists of its own (the rows themselves are never written in place)."""
    return _Seq(list(st.tokens), list(st.seen), list(st.rows), st.rows_from, st.anchor)


@dataclass(eq=False)
class MtpState:
    """The head's part of a slot's state (`save_seq`): its cells as llama.cpp serialises them and the sequence's
    bookkeeping (the tokens they hold, and the target rows and anchor a next prompt continues from)."""

    cells: bytearray
    seq: _Seq
    kind: str = MTP_KIND  # its drafter's `seq_kind` (an EAGLE-3 drafter keeps the same parts)
    drafter: str | None = None  # an EAGLE-3 drafter file's fingerprint (its cells are only valid for that file)

    @property
    def nbytes(self) -> int:
        rows = sum(r.nbytes for r in self.seq.rows) + (self.seq.anchor[1].nbytes if self.seq.anchor else 0)
        return len(self.cells) + rows

    def to_file(self) -> SeqFile:
        st = self.seq
        anchor = [] if st.anchor is None else [st.anchor[1]]
        width = next((r.size for r in (*st.rows, *anchor)), 0)
        meta = {"tokens": len(st.tokens), "seen": len(st.seen), "rows": len(st.rows), "rows_from": st.rows_from,
                "anchor": None if st.anchor is None else st.anchor[0], "width": width,
                **({} if self.drafter is None else {"drafter": self.drafter})}
        return SeqFile(self.kind, meta, (self.cells, ints_blob(st.tokens), ints_blob(st.seen), rows_blob(st.rows),
                                        rows_blob(anchor)))


def mtp_state_from_file(part: SeqFile, tokens: Sequence[int], width: int) -> MtpState:  # (kind: the part's)
    """An `MtpState.to_file` read back for a slot state holding `tokens`, the head `width` wide: ValueError naming
    the field that does not fit (the head's tokens and the target rows must be the slot's own)."""
    meta, count, n = part.meta, part.count, len(tokens)
    if meta.get("width") != width and (meta.get("rows") or meta.get("anchor") is not None):
        raise ValueError(f"width is {meta.get('width')!r}; the MTP head here is {width} wide")
    n_tokens, n_seen, n_rows = count("tokens", n), count("seen", n), count("rows", n)
    rows_from = count("rows_from", n - n_rows)
    anchor = None if meta.get("anchor") is None else count("anchor", n)
    sizes = (4 * n_tokens, 4 * n_seen, 4 * width * n_rows, 0 if anchor is None else 4 * width)
    if len(part.blobs) != 5 or tuple(len(b) for b in part.blobs[1:]) != sizes:
        raise ValueError(f"its blobs are {[len(b) for b in part.blobs]} bytes, its fields say [cells, *{list(sizes)}]")
    held, seen = part.ints(1), part.ints(2)
    if held != list(tokens[:n_tokens]) or seen != list(tokens[:n_seen]):
        raise ValueError("the head's tokens are not the slot's")
    kept = None if anchor is None else (anchor, part.rows(4, 1, width)[0])
    return MtpState(bytearray(part.blobs[0]), _Seq(held, seen, part.rows(3, n_rows, width), rows_from, kept),
                    part.kind, meta.get("drafter"))


class MtpDrafter(DrafterBase):
    reads_target = True  # fed the target's hidden state after each token (`target_rows`)
    seq_kind = MTP_KIND  # its part of a slot file
    cost_rule: type[MtpCost] = MtpCost  # its prices, under a measured-facts source of its own

    def __init__(self, target: ScoringModel) -> None:
        super().__init__()
        self.target = target
        self.models: tuple[ScoringModel, ...] = ()  # its context is the target's size, slots and all
        self._head = None
        self._seqs: dict[int, _Seq] = {}
        self._rng: dict[int, np.random.Generator] = {}
        self._zeros: np.ndarray | None = None

    @property
    def head(self):  # type: ignore[no-untyped-def]
        """The head's context, made when first used (its KV and compute buffer are counted by the memory
        preflight when the preset drafts with it)."""
        if self._head is None:
            from localspec.llama.mtp_head import MtpHead

            t = self.target
            # Device rows on a GPU only: the CPU backend's top-k sorts the whole row inside the graph, which cost
            # more than ranking it on the host (a tiny hybrid with a 152k vocabulary, one slot, T = 0.7: the head's
            # steps 4.8 -> 9.3 ms a round, the host's work 1.9 -> 1.5; docs/lab/2026-12-07-h100-hybrid-rounds.md).
            top_k = t.device_top_k if t.on_gpu else 0  # type: ignore[attr-defined]
            self._head = MtpHead(t, n_ctx=t.n_ctx, n_batch=min(MTP_BATCH, t.n_batch),  # type: ignore[arg-type]
                                 kv_type=t.kv_type, n_threads=t.n_threads, n_seq=t.n_seq,  # type: ignore[attr-defined]
                                 flash_attn=t.flash_attn, device_top_k=top_k)  # type: ignore[attr-defined]
            self._zeros = np.zeros(self._head.n_embd, dtype=np.float32)
        return self._head

    # -- the target's side ----------------------------------------------------------------------------------------

    @staticmethod
    def _kept_cells(st: _Seq, prompt: list[int]) -> int:
        """The head's cells a new prompt keeps: those still holding its tokens, never the last one (cur: the first
        draft scores it)."""
        return min(len(st.tokens), shared_prefix(st.tokens, prompt), len(prompt) - 1)

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int:
        st = self._seqs.get(req.seq, _Seq())
        m = self._kept_cells(st, prompt)
        if m == 0:
            return 0  # from position 0: every target row is needed
        valid = min(st.rows_to, shared_prefix(st.seen, prompt[:-1]))
        if st.rows_from <= m - 1 < valid:
            return valid  # its rows go on from where the target's cells end
        if st.anchor is not None and 0 < st.anchor[0] <= m:
            return st.anchor[0]  # the last prompt's end, where a recurrent target keeps its checkpoint
        return m - 1  # the target decodes again from the position whose row the head needs

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        st = self._seqs.setdefault(req.seq, _Seq())
        prompt = req.tokens
        m = min(self._kept_cells(st, prompt), kept + 1)
        valid = min(st.rows_to, shared_prefix(st.seen, prompt[:-1]), kept)
        if m == kept + 1 or m == 0:  # the target's rows from `kept` on are all the head needs
            rows: list[np.ndarray] = []
            first = kept
        elif st.rows_from <= m - 1 and valid == kept:
            rows, first = st.rows[m - 1 - st.rows_from : kept - st.rows_from], m - 1
        elif st.anchor is not None and st.anchor[0] == kept and kept <= m:
            m, rows, first = kept, [st.anchor[1]], kept - 1
        else:  # (the loop keeps the target within `target_limit`)
            raise UsageError(f"MTP drafter: sequence {req.seq} lost the target's hidden states")
        del st.tokens[m:]
        self.head.truncate(m, req.seq)
        st.rows, st.rows_from = rows, first
        st.seen = list(prompt[:kept])
        if st.anchor is not None and st.anchor[0] > m:
            st.anchor = None

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        st = self._seqs[req.seq]
        if start != st.rows_to:
            raise UsageError(f"MTP drafter: sequence {req.seq} got the target's rows from position {start}, "
                             f"expected {st.rows_to}")
        st.rows.extend(hidden)
        committed = len(req.tokens) - 1  # a prompt's part the target decodes: settle it now, as the target goes
        if st.rows_to <= committed:
            st.seen.extend(req.tokens[len(st.seen) : st.rows_to])
            self._catch_up(req, st.rows_to - 1)
            if st.rows_to == committed:  # the prompt is in: the next prompt that shares it starts here
                st.anchor = (committed, st.rows[-1])

    # -- the seam -------------------------------------------------------------------------------------------------

    def pricing(self, cost: DraftCost, drafting: Drafting) -> MtpCost:
        """The head's cost rule on this stream's facts: it prices the loop's adaptive k."""
        return self.cost_rule.of(cost)

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._rng[req.seq] = np.random.default_rng([req.sampling.seed, 2])
        # Its steps' rows as the draft model's: the device's top candidates or argmax where the sampling allows.
        self.head.use_sampler(device_mode(self.head, req.sampling, p_min=req.drafting.p_min,
                                          grammar_rows=req.grammar_rows if req.grammar is not None else None),
                              req.seq)
        return []  # its cells follow the target's decodes (`target_rows`)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        out: list[Proposal] = [NO_PROPOSAL] * len(jobs)
        for req, _ in jobs:
            self.spend(req, Spent())
        jobs = [(req, self.stand_aside(req, k, self.cost_rule)) for req, k in jobs]
        todo = [(i, req, k) for i, (req, k) in enumerate(jobs) if k > 0]
        if not todo:
            return out
        head = self.head
        drafted: dict[int, list[int]] = {i: [] for i, _, _ in todo}
        qs: dict[int, list[Candidates] | None] = {i: None if req.sampling.greedy else [] for i, req, _ in todo}
        seconds: dict[int, float] = dict.fromkeys(drafted, 0.0)
        first_s: dict[int, float] = dict.fromkeys(drafted, 0.0)
        least_s: dict[int, float | None] = dict.fromkeys(drafted)
        # The first step: each sequence's committed pairs not decoded yet, the last (cur) scored.
        entries, owner = [], []
        for i, req, _ in sorted(todo, key=lambda job: job[1].seq):
            cur = len(req.tokens) - 1
            entries += self._pairs(req, cur)
            owner.append(i)
        step = 0
        while entries:
            t = time.perf_counter()
            results = head.decode(entries)
            spent = time.perf_counter() - t
            nxt, nxt_owner = [], []
            for i, (row, own) in zip(owner, results, strict=True):
                req, k = jobs[i]
                seconds[i] += spent
                if step == 0:
                    first_s[i] = spent
                    st = self._seqs[req.seq]
                    st.tokens = list(req.tokens)  # the head's cells: the committed tokens, cur included
                    st.rows, st.rows_from = [], len(req.tokens) - 1  # consumed: the verify's rows come next
                elif least_s[i] is None or spent < least_s[i]:  # type: ignore[operator]
                    least_s[i] = spent
                token, confident = row_draft(req, row, drafted[i], qs[i], self._rng[req.seq],
                                             self.target.is_eog)
                if token is None:
                    continue
                drafted[i].append(token)
                # An unsure draft is usually wrong: verify what we have instead of drafting on.
                if len(drafted[i]) < k and confident:
                    pos = len(req.tokens) - 1 + len(drafted[i])
                    nxt.append((req.seq, token, pos, own, True))
                    nxt_owner.append(i)
            entries, owner = nxt, nxt_owner
            step += 1
        for i, req, _ in todo:
            committed = len(req.tokens)
            head.truncate(committed, req.seq)  # drafted positions go: the verify's rows replace them
            out[i] = Proposal(drafted[i], qs[i])
            self.spend(req, Spent(seconds[i], first_s[i], least_s[i]))
        return out

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """The target's cells now hold the committed tokens but the newest: its rows past them go."""
        st = self._seqs.get(req.seq)
        if st is None:
            return
        cells = len(req.tokens) - 1
        del st.rows[max(cells - st.rows_from, 0) :]
        st.seen.extend(req.tokens[len(st.seen) : cells])
        del st.seen[cells:]
        # Rows before the head's position are read already (the next pair needs the row at position m - 1).
        read = min(len(st.tokens) - 1 - st.rows_from, len(st.rows))
        if read > 0:
            del st.rows[:read]
            st.rows_from += read
        if len(st.rows) > ROWS_HELD:  # sitting rounds out: read them now rather than keep a row per token
            self._catch_up(req, cells - 1)

    # `cells`: none of a model's (the head is not one). Its cells and rows go into slot states through
    # `save_seq` / `load_seq` instead: a restored target hands it no rows, so without them a cache hit would decode
    # the target again from where the head's cells end (its bookkeeping by tokens says where).

    def save_seq(self, seq: int, tokens: Sequence[int]) -> MtpState | None:
        st = self._seqs.get(seq)
        if st is None or not st.tokens or self._head is None:
            return None
        return MtpState(self._head.save_state(seq), _copy(st), self.seq_kind)

    def seq_from_file(self, part: SeqFile, tokens: Sequence[int]) -> MtpState:
        return mtp_state_from_file(part, tokens, self.row_width)

    @property
    def row_width(self) -> int:
        """The floats of a row it reads and keeps (the target's hidden state; the head's own is as wide)."""
        return self.target.n_embd_out  # type: ignore[attr-defined]

    def load_seq(self, seq: int, state: SeqState | None) -> bool:
        assert state is None or isinstance(state, MtpState), "another drafter's state"
        if state is None:
            self._seqs.pop(seq, None)
            if self._head is not None:
                self._head.clear(seq)
            return True
        if not self.head.load_state(state.cells, seq):
            self._seqs.pop(seq, None)
            return False
        self._seqs[seq] = _copy(state.seq)  # (a copy: the cache's entry outlives what the stream does to it)
        return True

    def reset(self) -> None:
        if self._head is not None:
            self._head.clear()
        self._seqs.clear()

    def close(self) -> None:
        if self._head is not None:
            self._head.close()
            self._head = None

    # -- inside ---------------------------------------------------------------------------------------------------

    def _pairs(self, req: DraftRequest, last: int) -> list:
        """The head's entries for positions [its cells' end, last]: the token there and the target's hidden
        state before it (zeros before the first token); only the last is scored. A row it does not hold is an
        error (never another row's: a negative index would read one from the end)."""
        st = self._seqs[req.seq]
        first = len(st.tokens)
        out = []
        for p in range(first, last + 1):
            if p > 0 and not st.rows_from <= p - 1 < st.rows_to:
                raise DecodeError(f"MTP drafter: sequence {req.seq} needs the target's hidden state at position "
                                  f"{p - 1} and holds positions {st.rows_from}..{st.rows_to - 1} (a bookkeeping "
                                  "error: LOCALSPEC_DEBUG=1 shows where)")
            row = self._zeros if p == 0 else st.rows[p - 1 - st.rows_from]
            token = req.tokens[p]  # (a picture's position: the filler token, and the target's zero row after it)
            out.append((req.seq, token if token >= 0 else self.target.unknown_token, p, row, p == last))
        return out

    def _catch_up(self, req: DraftRequest, last: int) -> None:
        """Decode the pairs up to position `last` now (a prompt, as the target goes: bounded memory), keeping the
        one row the next position needs."""
        st = self._seqs[req.seq]
        if last < len(st.tokens):
            return
        entries = self._pairs(req, last)
        entries[-1] = (*entries[-1][:4], False)
        self.head.decode(entries)
        st.tokens = list(req.tokens[: last + 1])
        keep = last - st.rows_from  # the row at position `last`, which position last + 1 needs
        st.rows = st.rows[keep:]
        st.rows_from = last


def unavailable(target: ScoringModel, draft: ScoringModel | None = None) -> str | None:
    """Why these models have no MTP drafter (one clause), None when they have one."""
    layers = getattr(target, "mtp_layers", 0)
    if layers > 0:
        return None
    name = getattr(getattr(target, "path", None), "name", "the target")
    if getattr(target, "nextn_layers_in_file", 0) > 0:  # the file has them; this llama.cpp library cannot load them
        from localspec.llama.hidden import mtp_unsupported

        return f"{name} has MTP layers, but {mtp_unsupported() or 'they were not loaded'}"
    return f"{name} has no MTP layers: its GGUF has no nextn_predict_layers; an MTP GGUF of the model has them"


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: an MTP drafter where the target carries MTP layers."""
    return MtpDrafter(target) if unavailable(target) is None else None

