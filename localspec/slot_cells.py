"""A slot's cells in every model as one state: what the prompt cache keeps in host RAM and slot files write to disk
(`SlotCells.snapshot`, `restore`, `erase`), and how far cells restored from a state may be cut back (`floors`).

The engine owns one `SlotCells` over its slots: the target's cells (`Slot.target_kv`) and each drafter's own
models' (`Drafter.cells`), each with the bookkeeping list of the tokens they hold, which is rewritten in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.drafters.base import Drafter
from localspec.errors import UsageError
from localspec.prompt_cache import ModelState, PromptCache, SlotState, shared_prefix
from localspec.scores import ScoringModel
from localspec.stream import Slot

Cells = list[tuple[ScoringModel, list[int]]]  # (model, the tokens its cells of the slot hold)


class SlotCells:
    def __init__(self, target: ScoringModel, drafters: Sequence[Drafter], slots: Sequence[Slot]) -> None:
        self.target, self._drafters, self._slots = target, drafters, slots
        # Per (model, sequence) whose cells were restored from a state: the shortest length they may be cut back to
        # (`prompt_cache.ModelState.floor`); a prompt that shares less starts that model's cells afresh.
        self.floors: dict[tuple[int, int], int] = {}

    def cells(self, slot: int) -> Cells:
        """Every model's cells of a slot with their bookkeeping: the target's, then each drafter's own models'."""
        cells = [(self.target, self._slots[slot].target_kv)]
        for drafter in self._drafters:
            for model, kv in drafter.cells(slot):
                if all(model is not m for m, _ in cells):
                    cells.append((model, kv))
        return cells

    def models(self) -> list[ScoringModel]:
        """The models whose cells a slot's state holds, in `SlotState.models`' order: the target first."""
        return [model for model, _ in self.cells(0)]

    def check_context_shift(self) -> None:
        """Context shift drops tokens from the middle of a sequence: a recurrent state cannot (UsageError)."""
        for i, model in enumerate(self.models()):
            if model.recurrent:
                raise UsageError(f"context shift: the {'target' if i == 0 else 'draft'} has a recurrent state, which "
                                 "cannot drop tokens from its middle (turn context_shift off)")

    def snapshot(self, slot: int) -> SlotState:
        """Slot `slot`'s cells in every model, each rolled back to a prefix of its committed tokens (a draft's
        cells may hold drafted tokens past them), as llama.cpp serialises them. The slot must be idle."""
        s = self._slots[slot]
        assert not s.busy, "snapshot of a busy slot"
        models = []
        for model, kv in self.cells(slot):
            keep = shared_prefix(kv, s.tokens)
            if len(kv) > keep:
                del kv[keep:]  # bookkeeping first, as everywhere
                del kv[model.truncate(keep, slot):]  # (a recurrent state may keep less: a checkpoint, or nothing)
            models.append(ModelState(len(kv), model.save_state(slot), model.restore_floor(len(kv))))
        held = max(m.n_tokens for m in models)
        return SlotState(tuple(s.tokens[:held]), tuple(models))

    def restore(self, slot: int, state: SlotState) -> bool:
        """Put `state` (one ModelState per model of `models`, in its order) into idle slot `slot`; its earlier
        cells go. False when llama.cpp refuses a model's state: the slot is then empty."""
        s = self._slots[slot]
        assert not s.busy, "restore into a busy slot"
        cells = self.cells(slot)
        assert len(cells) == len(state.models), "one state per model"
        for (model, kv), saved in zip(cells, state.models, strict=True):
            kv.clear()
            self.floors.pop((id(model), slot), None)
            if saved.n_tokens == 0:
                model.clear(slot)
                continue
            if not model.load_state(saved.data, slot):
                self.erase(slot)
                return False
            kv.extend(state.tokens[: saved.n_tokens])
            if saved.floor:
                self.floors[(id(model), slot)] = saved.floor
        s.tokens[:] = state.tokens
        return True

    def erase(self, slot: int) -> int:
        """Empty slot `slot`'s cells in every model; returns how many tokens the target's held."""
        s = self._slots[slot]
        assert not s.busy, "erase of a busy slot"
        held = len(s.target_kv)
        for model, kv in self.cells(slot):
            kv.clear()
            model.clear(slot)
            self.floors.pop((id(model), slot), None)
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
        needs them from below that floor (`target_limit`: `ReadsTarget.target_limit`)."""
        for model, kv in self.cells(slot):
            floor = self.floors.get((id(model), slot))
            if floor is None:
                continue
            if not self.reuse(slot, model, kv, body) or (model is self.target and target_limit is not None
                                                         and floor > target_limit):
                del self.floors[(id(model), slot)]
                kv.clear()
                model.clear(slot)

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
