"""The DFlash and DSpark drafters: a block drafter (docs/dflash.md) reads the target's layer-input features and drafts
a whole block of tokens in one decode of its own context.

The drafter's GGUF (general.architecture `dflash`) loads over the target (`LlamaModel(other=target)`: llama.cpp's
`ctx_other`, whose token embeddings and output head a drafter without its own reads). The target returns, for the
streams of this drafter, the inputs of the drafter's `target_layers`, concatenated per token (`LlamaModel.want_hidden`
with `layers`), for every token it decodes, prompt chunks and verifies alike (the target-rows hook). The drafter
injects each committed position's row into its own KV cache at that position (an embd batch: K and V of `fc`'s fused
feature, no logits), so its cells hold positions [0, len(tokens) - 1): every committed token but cur, whose row the
next verify brings. A prompt's rows are injected as the target goes (bounded memory); a verify's are kept until the
verdict (`rewind` drops the rejected ones) and injected at the start of the next draft.

A draft decodes one block at cur's position: DFlash `[cur, MASK x n]`, row i (1..n) predicting position i;
DSpark (`sample_from_anchor`) `[cur, MASK x (n - 1)]`, row i (0..n-1) predicting position i + 1, its Markov head
chaining each row on the argmax of the one before (in the graph). n is always the block's full length (its trained
shape; the decode costs about the same at any n), and the proposal is its first k rows: the argmax at T = 0, a sample
from the row's own distribution under the request's sampling at T > 0 (with that row as q, so rejection sampling keeps
the target's distribution: each row is fixed before its token is drawn, whatever the tokens drawn before it). Then
the block's cells go again. DSpark's confidence head cuts the proposal before the first position it rates below
`[draft] dspark_p_min`; `[draft] p_min` stops it after the first row whose top probability is below it, as the
other drafters do.

Its prices (`DFlashCost`, `DSparkCost`): the draft model's rule (`model.ModelCost`: acceptance per position, probes
while judged a loss) with a source of its own, except that any length up to the block's costs one drafter decode
(the measured "step" is the whole block's decode) and a length beyond the block is never priced to pay.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    row_draft,
    shared_prefix,
)
from localspec.drafters.model import ModelCost
from localspec.errors import DecodeError, LocalspecError, UsageError
from localspec.llama.layer_features import (
    BlockContext,
    BlockDrafterFacts,
    check_block_drafter,
    layer_features_unsupported,
)
from localspec.rounds.policies import DraftCost
from localspec.rounds.prompt_cache import SeqFile, SeqState, ints_blob, rows_blob
from localspec.rounds.sampling import Candidates
from localspec.rounds.scores import ScoringModel
from localspec.rounds.slot_file import fingerprint

LLAMA_SERVER_TYPE = "draft-dflash"  # its `speculative.type` (llama-server's name)
ROWS_HELD = 64  # the target rows a sequence keeps for a drafter sitting rounds out before it injects them


class DFlashCost(ModelCost):
    """A block drafter's prices: the draft model's rule over its own acceptance per position, but a round of any n
    drafts (1..the block's) costs one drafter decode: the measured step (`Spent.least_s`) is the block's decode."""

    SOURCE = "dflash"
    max_drafts = 1 << 30  # the block's drafts (set by `pricing`): a longer round is never priced to pay

    def seconds(self, lead: np.ndarray, n: np.ndarray, verify: np.ndarray, perfect: bool) -> np.ndarray:
        n = np.asarray(n)
        block = np.where(n > 0, self.cost.step_s or 0.0, 0.0)
        return np.where(n > self.max_drafts, np.inf, block)


class DSparkCost(DFlashCost):
    SOURCE = "dspark"


@dataclass(eq=False)
class _Seq:
    """One sequence: the positions whose features the drafter's cells hold, and the target's rows not injected."""

    seen: list[int] = field(default_factory=list)  # the tokens at the injected positions [0, len(seen))
    pending: list[np.ndarray] = field(default_factory=list)  # target rows of positions [len(seen), ...)
    cuts: int = 0  # proposals DSpark's confidence head made shorter than k

    @property
    def fed(self) -> int:
        return len(self.seen)


@dataclass(eq=False)
class BlockState:
    """The drafter's part of a slot's state (`save_seq`): its cells as llama.cpp serialises them and the positions
    they hold (with the target rows not injected yet)."""

    cells: bytearray
    seq: _Seq
    kind: str  # dflash or dspark
    drafter: str  # the drafter file's fingerprint (its cells are only valid for that file)

    @property
    def nbytes(self) -> int:
        return len(self.cells) + sum(r.nbytes for r in self.seq.pending)

    def to_file(self) -> SeqFile:
        st = self.seq
        meta = {"drafter": self.drafter, "seen": len(st.seen), "pending": len(st.pending), "cuts": st.cuts}
        return SeqFile(self.kind, meta, (self.cells, ints_blob(st.seen), rows_blob(st.pending)))


class BlockDrafter(DrafterBase):
    """DFlash or DSpark over `draft` (the drafter's GGUF, loaded over the target: `LlamaModel(other=target)`)."""

    reads_target = True  # fed the target's layer features after each token (`target_rows`)

    def __init__(self, target: ScoringModel, draft: ScoringModel, facts: BlockDrafterFacts) -> None:
        super().__init__()
        self.target, self._model, self.facts = target, draft, facts
        self.models: tuple[ScoringModel, ...] = ()  # its cells follow the target's (target_rows), not the loop's
        self._seqs: dict[int, _Seq] = {}
        self._rng: dict[int, np.random.Generator] = {}
        self._context = BlockContext(draft, facts)  # its llama.cpp calls (behind the llama layer's wall)
        self._path = Path(draft.path)  # type: ignore[attr-defined]  # (its cells in slot files name the file)

    # -- the target's side ----------------------------------------------------------------------------------------

    def target_limit(self, req: DraftRequest, prompt: list[int]) -> int:
        st = self._seqs.get(req.seq, _Seq())
        return min(st.fed, shared_prefix(st.seen, prompt))  # the target decodes again from where its features end

    def target_kept(self, req: DraftRequest, kept: int) -> None:
        st = self._seqs.setdefault(req.seq, _Seq())
        if kept > st.fed:  # (the loop keeps the target within `target_limit`)
            raise UsageError(f"{self.facts.kind} drafter: sequence {req.seq} lost the target's features")
        self._cut(req.seq, st, kept)

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        st = self._seqs[req.seq]
        if start != st.fed + len(st.pending):
            raise DecodeError(f"{self.facts.kind} drafter: sequence {req.seq} got the target's rows from position "
                              f"{start}, expected {st.fed + len(st.pending)}")
        if hidden.shape[1] != self._context.width:
            raise DecodeError(f"{self.facts.kind} drafter: the target's rows are {hidden.shape[1]} wide, its features "
                              f"{self._context.width} (did the target return NextN rows?)")
        st.pending.extend(hidden)
        if start + len(hidden) < len(req.tokens):  # a prompt's chunk: every row is committed, inject it now
            self._inject(req.seq, req.tokens, st)

    # -- the seam -------------------------------------------------------------------------------------------------

    def pricing(self, cost: DraftCost, drafting: Drafting) -> DFlashCost:
        """The block's cost rule on this stream's facts: it prices the loop's adaptive k."""
        rule = (DSparkCost if self.facts.kind == "dspark" else DFlashCost).of(cost)
        rule.max_drafts = self.facts.max_drafts
        return rule

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        self._rng[req.seq] = np.random.default_rng([req.sampling.seed, 3])
        self.target.want_hidden(req.seq, True, self.facts.layers)  # type: ignore[call-arg]
        self._model.use_device_sampler(None, req.seq)  # full rows: q is the drafter's whole distribution
        return []  # its cells follow the target's decodes (`target_rows`)

    def draft(self, jobs: Sequence[tuple[DraftRequest, int]]) -> list[Proposal]:
        out: list[Proposal] = [NO_PROPOSAL] * len(jobs)
        for req, _ in jobs:
            self.spend(req, Spent())
        rule = DSparkCost if self.facts.kind == "dspark" else DFlashCost
        jobs = [(req, self.stand_aside(req, k, rule)) for req, k in jobs]
        todo = [(i, req, k) for i, (req, k) in enumerate(jobs)
                if k > 0 and len(req.tokens) - 1 + self._context.block <= self._model.n_ctx]
        if not todo:
            return out
        t = time.perf_counter()
        for _, req, _ in todo:
            st = self._seqs[req.seq]
            self._inject(req.seq, req.tokens, st)
            if st.fed != len(req.tokens) - 1:
                raise DecodeError(f"{self.facts.kind} drafter: sequence {req.seq} holds the features of "
                                  f"{st.fed} positions, its block needs {len(req.tokens) - 1} (a bookkeeping error: "
                                  "LOCALSPEC_DEBUG=1 shows where)")
        injected = time.perf_counter() - t
        t = time.perf_counter()
        rows, conf = self._decode_blocks([req for _, req, _ in todo])  # (the blocks' cells go again)
        block_s = time.perf_counter() - t
        for j, (i, req, k) in enumerate(todo):
            n = min(k, self.facts.max_drafts)
            p_cut = req.drafting.dspark_p_min
            st = self._seqs[req.seq]
            if conf is not None and p_cut > 0.0:
                below = np.flatnonzero(conf[j][:n] < p_cut)
                if below.size:
                    n = int(below[0])
                    st.cuts += 1
            drafted: list[int] = []
            q: list[Candidates] | None = None if req.sampling.greedy else []
            for row in rows[j][:n]:
                token, confident = row_draft(req, row, drafted, q, self._rng[req.seq], self.target.is_eog)
                if token is None:
                    break
                drafted.append(token)
                if not confident:  # an unsure draft is usually wrong: verify what we have
                    break
            out[i] = Proposal(drafted, q)
            seconds = injected + block_s
            self.spend(req, Spent(seconds, first_s=seconds, least_s=block_s))
        return out

    def rewind(self, req: DraftRequest, proposal: Proposal, accepted: int) -> None:
        """The target's cells now hold the committed tokens but the newest: the rows and cells past them go."""
        st = self._seqs.get(req.seq)
        if st is None:
            return
        cells = len(req.tokens) - 1
        if cells < st.fed:  # (a reply that ended inside the round cut the committed tokens back)
            self._cut(req.seq, st, cells)
        del st.pending[cells - st.fed :]
        if len(st.pending) > ROWS_HELD:  # sitting rounds out: inject them now rather than keep a row per token
            self._inject(req.seq, req.tokens, st)

    # `cells`: none of a model's (the loop must not decode prompts into them). Its cells and the rows it has not
    # injected go into slot states through `save_seq` / `load_seq` instead: a restored target hands it no rows, so
    # without them a cache hit would decode the target again from where its features end (`target_limit`).

    @property
    def seq_kind(self) -> str:  # type: ignore[override]
        return self.facts.kind

    def save_seq(self, seq: int, tokens: Sequence[int]) -> BlockState | None:
        st = self._seqs.get(seq)
        if st is None:
            return None
        self._inject(seq, tokens, st)  # (rows held for the next draft go in now: the state then serves all of them)
        if not st.seen:
            return None
        return BlockState(self._model.save_state(seq), _Seq(list(st.seen), list(st.pending), st.cuts),
                          self.facts.kind, self._fingerprint())

    def seq_from_file(self, part: SeqFile, tokens: Sequence[int]) -> BlockState:
        """A `BlockState.to_file` read back: ValueError naming what does not fit (another drafter file, features of
        another width, positions that are not the slot's)."""
        meta, n, width = part.meta, len(tokens), self._context.width
        if meta.get("drafter") != self._fingerprint():
            raise ValueError(f"saved with another drafter file than {self._path.name}")
        seen, pending, cuts = (part.count(name, n) for name in ("seen", "pending", "cuts"))
        if seen + pending > n:
            raise ValueError(f"it holds {seen} + {pending} positions of a state of {n} tokens")
        sizes = (4 * seen, 4 * width * pending)
        if len(part.blobs) != 3 or tuple(len(b) for b in part.blobs[1:]) != sizes:
            raise ValueError(f"its blobs are {[len(b) for b in part.blobs]} bytes, its fields say [cells, "
                             f"*{list(sizes)}] at this drafter's feature width {width}")
        held = part.ints(1)
        if held != list(tokens[:seen]):
            raise ValueError("its positions' tokens are not the slot's")
        return BlockState(bytearray(part.blobs[0]), _Seq(held, part.rows(2, pending, width), cuts), self.facts.kind,
                          self._fingerprint())

    def _fingerprint(self) -> str:
        """The drafter file's identity (slot_file.fingerprint: cached by path, size and mtime)."""
        return fingerprint(self._path)

    def load_seq(self, seq: int, state: SeqState | None) -> bool:
        assert state is None or isinstance(state, BlockState), "another drafter's state"
        if state is None or not self._model.load_state(state.cells, seq):
            self._seqs.pop(seq, None)
            self._model.clear(seq)
            return state is None
        self._seqs[seq] = _Seq(list(state.seq.seen), list(state.seq.pending), state.seq.cuts)  # (the entry stays)
        return True

    def reset(self) -> None:
        self._model.clear()
        self._seqs.clear()

    def close(self) -> None:
        self._context.close()

    def confidence_cuts(self, seq: int) -> int:
        """Proposals of sequence `seq` that DSpark's confidence head made shorter than the loop's k."""
        st = self._seqs.get(seq)
        return 0 if st is None else st.cuts

    # -- inside ---------------------------------------------------------------------------------------------------

    def _cut(self, seq: int, st: _Seq, keep: int) -> None:
        del st.seen[keep:]
        st.pending.clear()
        self._model.truncate(keep, seq)

    def _inject(self, seq: int, tokens: Sequence[int], st: _Seq) -> None:
        """Decode the pending rows of committed positions (of `tokens`) into the drafter's cells."""
        first = st.fed
        rows = st.pending[: max(0, len(tokens) - first)]
        if rows:
            self._context.inject(seq, first, np.stack(rows))
        st.seen.extend(tokens[first : first + len(rows)])
        del st.pending[: len(rows)]

    def _decode_blocks(self, reqs: list[DraftRequest]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Each request's block at cur's position: its drafting rows and (a confidence head's) confidences."""
        return self._context.blocks([(req.seq, req.tokens[-1], len(req.tokens) - 1) for req in reqs])


# -- the factory ----------------------------------------------------------------------------------------------------


def facts_of(target: ScoringModel, draft: ScoringModel | None, kind: str) -> tuple[BlockDrafterFacts | None, str]:
    """The pair's block-drafter facts where `draft` is a drafter of this `kind` for `target`, else None and why (one
    clause: the header check's line, naming the file and key)."""
    from localspec.models.gguf_header import read_header

    title = "DSpark" if kind == "dspark" else "DFlash"
    if draft is None or getattr(draft, "path", None) is None or getattr(target, "path", None) is None:
        return None, f"the {title} drafter is a draft model's GGUF (general.architecture dflash): name it as the draft"
    why = layer_features_unsupported()
    if why is not None:
        return None, why
    try:
        facts = check_block_drafter(read_header(target.path), read_header(draft.path),  # type: ignore[attr-defined]
                                    verify_width=target.n_batch)  # type: ignore[attr-defined]
    except LocalspecError as exc:
        return None, str(exc)
    if facts.kind != kind:
        other = "dspark" if facts.kind == "dspark" else "dflash"
        return None, f"{draft.path.name} is a {facts.title} drafter: --drafter {other}"  # type: ignore[attr-defined]
    if getattr(draft, "ctx", None) is None or getattr(draft, "n_batch", 0) < facts.max_drafts + 1:
        return None, f"{draft.path.name}: its context takes fewer than a block's {facts.max_drafts + 1} tokens a decode"  # type: ignore[attr-defined]
    return facts, ""


def unavailable(target: ScoringModel, draft: ScoringModel | None = None) -> str | None:
    """Why these models have no DFlash drafter (one clause), None when they have one."""
    facts, why = facts_of(target, draft, "dflash")
    return None if facts is not None else why


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: a DFlash drafter where the draft is one for this target (`check_block_drafter`)."""
    facts, _ = facts_of(target, draft, "dflash")
    return None if facts is None else BlockDrafter(target, draft, facts)  # type: ignore[arg-type]
