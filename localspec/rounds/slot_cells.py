"""A slot's cells in every model: which free slot's cells serve a prompt best (`free_slot`); bringing them to a
stream's prompt, reusing the prefix they hold (`prefill`, `decode`) and context shift (`shift`); and as one state,
what the prompt cache keeps in host RAM and slot files write to disk (`SlotCells.snapshot`, `restore`, `erase`), and
how far cells restored from a state may be cut back (`floors`).

The engine owns one `SlotCells` over its slots: the target's cells (`Slot.target_kv`) and each drafter's own
models' (`Drafter.cells`, a copy of the tokens they hold), each with its bookkeeping of the tokens they hold, which
is rewritten after every change (`_set`: the slot's list, or the drafter's `set_cells`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from localspec.drafters.base import Drafter, PromptWork, prompt_work
from localspec.errors import UsageError
from localspec.llama.vision import holds_pictures
from localspec.rounds import context_shift
from localspec.rounds.prompt_cache import (
    ModelState,
    PromptCache,
    SeqFile,
    SeqState,
    SlotState,
    picture_boundary,
    shared_prefix,
)
from localspec.rounds.scores import ScoringModel
from localspec.rounds.slot_file import SlotFileError
from localspec.rounds.stream import Slot, Stream

Cells = list[tuple[ScoringModel, list[int]]]  # (model, the tokens its cells of the slot hold)


class SlotCells:
    def __init__(self, target: ScoringModel, drafters: Sequence[Drafter], slots: Sequence[Slot]) -> None:
        self.target, self._drafters, self._slots = target, drafters, slots
        # Per (model, sequence) whose cells were restored from a state: the shortest length they may be cut back to
        # (`prompt_cache.ModelState.floor`); a prompt that shares less starts that model's cells afresh.
        self.floors: dict[tuple[int, int], int] = {}

    def cells(self, slot: int) -> Cells:
        """Every model's cells of a slot with the tokens they hold (copies): the target's, then each drafter's own
        models'."""
        cells = [(self.target, list(self._slots[slot].target_kv))]
        for drafter in self._drafters:
            for model, kv in drafter.cells(slot):
                if all(model is not m for m, _ in cells):
                    cells.append((model, kv))
        return cells

    def _set(self, slot: int, model: ScoringModel, tokens: Sequence[int]) -> None:
        """The bookkeeping of `model`'s cells of the slot: they now hold `tokens`."""
        if model is self.target:
            self._slots[slot].target_kv[:] = tokens
            return
        for drafter in self._drafters:
            if any(model is m for m, _ in drafter.cells(slot)):
                drafter.set_cells(slot, model, tokens)
                return

    def models(self) -> list[ScoringModel]:
        """The models whose cells a slot's state holds, in `SlotState.models`' order: the target first."""
        return [model for model, _ in self.cells(0)]

    def check_context_shift(self) -> None:
        """Context shift drops tokens from the middle of a sequence: a recurrent state cannot (UsageError)."""
        for i, model in enumerate(self.models()):
            if model.recurrent:
                raise UsageError(f"context shift: the {'target' if i == 0 else 'draft'} has a recurrent state, which "
                                 "cannot drop tokens from its middle (turn context_shift off)")

    def check_pictures(self, prompt: Sequence[int], s: Stream) -> None:
        """A prompt that holds pictures (llama.vision's placeholder ids) needs the target's projector and text after
        its last picture; context shift would cut a picture: each a UsageError naming it (before any cell changes).
        Every drafter drafts around pictures (the target's rows there are zeros: `LlamaModel._decode_pictures`)."""
        projector = getattr(self.target, "projector", None)
        if projector is None:
            raise UsageError("the prompt holds a picture, but no projector (mmproj) is loaded for the target "
                             "(--mmproj PATH)")
        projector.pictures_in(prompt)  # (every picture still held by a prompt: else one line now, not mid-round)
        if prompt[-1] < 0:
            raise UsageError("the prompt ends with a picture: text must follow it (a chat template adds it)")
        if s.shift is not None:
            raise UsageError("context shift cannot drop part of a picture: turn context_shift off for prompts with "
                             "pictures")

    def snapshot(self, slot: int) -> SlotState:
        """Slot `slot`'s cells in every model, each rolled back to a prefix of its committed tokens (a draft's
        cells may hold drafted tokens past them), as llama.cpp serialises them. The slot must be idle."""
        s = self._slots[slot]
        assert not s.busy, "snapshot of a busy slot"
        models = []
        for model, kv in self.cells(slot):
            keep = shared_prefix(kv, s.tokens)
            if len(kv) > keep:
                del kv[keep:]
                self._set(slot, model, kv)  # bookkeeping first, as everywhere
                del kv[model.truncate(keep, slot):]  # (a recurrent state may keep less: a checkpoint, or nothing)
                self._set(slot, model, kv)
            models.append(ModelState(len(kv), model.save_state(slot), model.restore_floor(len(kv))))
        held = max(m.n_tokens for m in models)
        drafters = tuple(d.save_seq(slot, s.tokens) for d in self._drafters)
        return SlotState(tuple(s.tokens[:held]), tuple(models), drafters)

    def restore(self, slot: int, state: SlotState) -> bool:
        """Put `state` (one ModelState per model of `models`, in its order) into idle slot `slot`; its earlier
        cells go. False when llama.cpp refuses a model's state: the slot is then empty."""
        s = self._slots[slot]
        assert not s.busy, "restore into a busy slot"
        cells = self.cells(slot)
        assert len(cells) == len(state.models), "one state per model"
        for (model, _), saved in zip(cells, state.models, strict=True):
            self._set(slot, model, ())
            self.floors.pop((id(model), slot), None)
            if saved.n_tokens == 0:
                model.clear(slot)
                continue
            if not model.load_state(saved.data, slot):
                self.erase(slot)
                return False
            self._set(slot, model, state.tokens[: saved.n_tokens])
            if saved.floor:
                self.floors[(id(model), slot)] = saved.floor
        s.tokens[:] = state.tokens
        for i, drafter in enumerate(self._drafters):  # (a state without the drafters' parts: each forgets the slot)
            if not drafter.load_seq(slot, state.drafters[i] if state.drafters else None):
                self.erase(slot)
                return False
        return True

    def with_parts(self, state: SlotState, parts: Sequence[SeqFile]) -> SlotState:
        """A state read from a slot file, with the drafters' parts it holds (`SeqFile`) read back by the drafters of
        their kind, in the engine's order (a part no drafter here reads is left out, as a draft model the engine
        lacks); SlotFileError naming the part that does not fit, before any cell changes."""
        by_kind = {part.kind: part for part in parts}
        drafters: list[SeqState | None] = []
        for drafter in self._drafters:
            part = by_kind.get(drafter.seq_kind) if drafter.seq_kind else None
            if part is None:
                drafters.append(None)
                continue
            try:
                drafters.append(drafter.seq_from_file(part, state.tokens))
            except ValueError as exc:
                raise SlotFileError(f"its {part.kind} drafter's part does not fit: {exc}") from None
        return dataclasses.replace(state, drafters=tuple(drafters))

    def erase(self, slot: int) -> int:
        """Empty slot `slot`'s cells in every model; returns how many tokens the target's held."""
        s = self._slots[slot]
        assert not s.busy, "erase of a busy slot"
        held = len(s.target_kv)
        for model, _ in self.cells(slot):
            self._set(slot, model, ())
            model.clear(slot)
            self.floors.pop((id(model), slot), None)
        for drafter in self._drafters:
            drafter.load_seq(slot, None)
        s.tokens.clear()
        return held

    def reuse(self, slot: int, model: ScoringModel, kv: list[int], body: Sequence[int]) -> int:
        """How much of `body` a model's cells of the slot can keep: the shared prefix, or nothing where that is
        shorter than a restored state may be cut back to."""
        n = shared_prefix(kv, body)
        return n if n >= self.floors.get((id(model), slot), 0) else 0

    def start_afresh_below_floor(self, slot: int, body: Sequence[int], target_limit: int | None = None) -> None:
        """Before a prompt `body` goes into the slot: restored cells that it shares less of than their floor are
        emptied (they could not be cut back that far); so are the target's where the drafter that reads its rows
        needs them from below that floor (`target_limit`: `Drafter.target_limit`)."""
        for model, kv in self.cells(slot):
            floor = self.floors.get((id(model), slot))
            if floor is None:
                continue
            if not self.reuse(slot, model, kv, body) or (model is self.target and target_limit is not None
                                                         and floor > target_limit):
                del self.floors[(id(model), slot)]
                self._set(slot, model, ())
                model.clear(slot)

    # A cached prefix at least this long decides the slot; a shorter one only breaks ties. Every decode of a round
    # spans the sequence ids from the lowest busy slot to the highest and pads the free ones in between
    # (llama.ubatch.covering_calls): a gap costs a draft step's and a verify's width of tokens every round, more
    # over a reply than re-reading a short prefix once.
    LONG_PREFIX = 256

    def free_slot(self, prompt: Sequence[int], exclude: Collection[int] = ()) -> int | None:
        """The free slot for `prompt`: the one whose cells share a long prefix with it (a returning conversation
        goes back to its cache), else the one that keeps the busy slots' ids closest together, then the longest
        shared prefix, then the least recently used; None when every slot is busy (or in `exclude`: promised to
        another job)."""
        free = [s for s in self._slots if not s.busy and s.seq not in exclude]
        if not free:
            return None
        busy = [s.seq for s in self._slots if s.busy or s.seq in exclude]  # the promised ones are about to be

        def key(s: Slot) -> tuple[int, int, int, int]:
            reuse = shared_prefix(s.target_kv, prompt)
            span = max(busy + [s.seq]) - min(busy + [s.seq])
            return (reuse if reuse >= self.LONG_PREFIX else 0, -span, reuse, -s.used)

        return max(free, key=key).seq

    # -- bringing a slot's cells to a prompt ---------------------------------------------------------------------

    def prefill(self, s: Stream, prompt: list[int]) -> list[PromptWork]:
        """Cut the slot's cells (the target's, and the drafter's models') back to the longest prefix of
        prompt[:-1] they hold; returns, per model, (model, its cells' tokens, the tokens still to decode)."""
        if holds_pictures(prompt):
            self.check_pictures(prompt, s)
        slot = s.slot
        limit = s.drafter.target_limit(s.req, prompt) if s.drafter is not None else None
        self.start_afresh_below_floor(slot.seq, prompt[:-1], limit)
        work = [prompt_work(self.target, slot.target_kv, prompt[:-1], slot.seq, limit)]
        slot.stale_cells = False  # (prompt_work truncated the target's cells to its bookkeeping)
        s.stats.prompt_tokens_processed = len(work[0][2])
        slot.tokens[:] = prompt  # (in place: the stream's DraftRequest reads the same list)
        if s.drafter is not None:
            s.drafter.target_kept(s.req, len(slot.target_kv))
            work += s.drafter.start(s.req, prompt, s.chooser)
        return [w for w in work if w[2]]

    def decode(self, s: Stream, whole: bool) -> None:
        """Decode the stream's pending prompt work into every model: all of it, or one batch of each."""
        for model, kv, todo in s.prefill:
            take = todo if whole else todo[: batch_cut(todo, model.n_batch)]
            scores = model.decode(take, len(kv), seq=s.slot.seq)
            if model is self.target and s.drafter is not None and s.drafter.reads_target:
                assert scores is not None and scores.hidden is not None
                s.drafter.target_rows(s.req, len(kv), scores.hidden)
            kv.extend(take)
            if model is not self.target:  # (a drafter's model: its bookkeeping is the drafter's)
                self._set(s.slot.seq, model, kv)
            del todo[: len(take)]
            if model is self.target and not todo:
                # A recurrent state is rewound to here for the next prompt that shares this one (a chat's next
                # turn); it cannot be rolled back that far otherwise.
                model.checkpoint(s.slot.seq)
        s.prefill = [t for t in s.prefill if t[2]]

    def shift(self, s: Stream, n_ctx: int) -> None:
        """Context shift (context_shift.py): keep the first n_keep tokens, drop the next n_discard, and decode the
        rest again at their new positions in every model, as a fresh context holding the shifted tokens would."""
        assert s.shift is not None
        tokens = s.slot.tokens
        shift = context_shift.plan(len(tokens) - 1, n_ctx, s.stats.prompt_tokens, s.shift.n_keep,
                                   s.shift.n_discard, self.target.add_bos)
        processed = s.stats.prompt_tokens_processed
        s.prefill = self.prefill(s, context_shift.shifted(tokens, shift))
        s.stats.prompt_tokens_processed = processed
        s.stats.context_shifts += 1
        s.stats.shift_tokens += sum(len(todo) for model, _, todo in s.prefill if model is self.target)
        self.decode(s, whole=True)

    def from_cache(self, cache: PromptCache, slot: Slot, prompt: Sequence[int]) -> None:
        """llama-server's prompt cache: when the slot would keep less than half of what its cells hold (it is
        given to another prompt), its state goes to the cache first; then an entry that serves more of the
        prompt than the slot does is restored into it."""
        body = prompt[:-1]
        kept = self.reuse(slot.seq, self.target, slot.target_kv, body)
        if slot.target_kv and 2 * kept >= len(slot.target_kv):
            return  # the conversation it holds goes on
        if slot.target_kv:
            cache.put(self.snapshot(slot.seq))
        found = cache.best(body, better_than=kept)
        if found is not None:
            self.restore(slot.seq, found[0])


def batch_cut(todo: Sequence[int], n_batch: int) -> int:
    """How much of a prompt's pending tokens one round's batch takes: n_batch, never a part of a picture (a picture
    goes whole; pictures at the front go together, each in its own decode)."""
    n = picture_boundary(todo, n_batch)
    if n == 0 and todo and todo[0] < 0:
        n = next((i for i, t in enumerate(todo) if t >= 0), len(todo))
    return n
