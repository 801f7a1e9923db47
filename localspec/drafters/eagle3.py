"""The EAGLE-3 drafter: a one-block decoder that drafts from three of the target's layers (docs/dflash.md).

Its GGUF (general.architecture eagle3) is the draft model, loaded over the target (llama.cpp's ctx_other: it reads the
target's token embeddings and output head). Where the MTP head reads the target's final hidden state, EAGLE-3 reads
the inputs of three target layers (`eagle3.target_layers`, `LlamaModel.want_hidden(layers=...)`), fused into one row
a position by its ENCODE pass (`fc`: `Eagle3Head.encode`); from there it is the MTP head's scheme, and this drafter
is `MtpDrafter` with another head: at position p its decoder reads the token x_p and the fused row of p - 1, scores
x_{p+1}, and its own hidden state stands in for the next row while it drafts on. llama.cpp's own loop for it
(`draft-eagle3`) samples and matches at T > 0; here its drafts are sampled from its own distribution and verified by
rejection sampling, as every drafter's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from localspec.drafters.base import Drafter, DraftRequest, PromptWork
from localspec.drafters.mtp import MtpCost, MtpDrafter, MtpState
from localspec.errors import LocalspecError
from localspec.llama.layer_features import EAGLE3_ARCH, Eagle3Facts, check_eagle3_drafter, layer_features_unsupported
from localspec.rounds.prompt_cache import SeqFile
from localspec.rounds.scores import ScoringModel
from localspec.rounds.slot_file import fingerprint

EAGLE3_KIND = "eagle3"  # its parts in slot files
LLAMA_SERVER_TYPE = "draft-eagle3"  # its `speculative.type` (llama-server's name)


class Eagle3Cost(MtpCost):
    """The head's prices (the MTP head's rule) over its own measured steps and acceptance."""

    SOURCE = "eagle3"


class Eagle3Drafter(MtpDrafter):
    seq_kind = EAGLE3_KIND
    cost_rule = Eagle3Cost

    def __init__(self, target: ScoringModel, draft: ScoringModel, facts: Eagle3Facts) -> None:
        super().__init__(target)
        self._model = draft  # (the drafter GGUF's LlamaModel: `draft` is the seam's method)
        self.facts = facts

    @property
    def head(self):  # type: ignore[no-untyped-def]
        """The draft model's context as an EAGLE-3 head (made when first used)."""
        if self._head is None:
            from localspec.llama.mtp_head import Eagle3Head

            self._head = Eagle3Head(self._model, n_seq=self.target.n_seq)  # type: ignore[arg-type]
            self._zeros = np.zeros(self._head.n_embd, dtype=np.float32)
        return self._head

    @property
    def row_width(self) -> int:
        return int(self.head.n_embd)  # (the fused rows it keeps are its own width)

    def begin(self, req: DraftRequest, prompt: list[int]) -> list[PromptWork]:
        work = super().begin(req, prompt)
        self.target.want_hidden(req.seq, True, self.facts.layers)  # type: ignore[call-arg]
        self._model.use_device_sampler(None, req.seq)  # full rows: q is the drafter's whole distribution
        return work

    def save_seq(self, seq: int, tokens: Sequence[int]) -> MtpState | None:
        state = super().save_seq(seq, tokens)
        return None if state is None else dataclasses.replace(state, drafter=fingerprint(self._model.path))

    def seq_from_file(self, part: SeqFile, tokens: Sequence[int]) -> MtpState:
        if part.meta.get("drafter") != fingerprint(self._model.path):  # type: ignore[attr-defined]
            raise ValueError("its cells were saved with another drafter file")
        return super().seq_from_file(part, tokens)

    def target_rows(self, req: DraftRequest, start: int, hidden: np.ndarray) -> None:
        """The target's layer inputs of these positions, fused by the encoder into the rows the decoder reads."""
        super().target_rows(req, start, self.head.encode(hidden))


def facts_of(target: ScoringModel, draft: ScoringModel | None) -> tuple[Eagle3Facts | None, str]:
    """The pair's EAGLE-3 facts where `draft` is an EAGLE-3 drafter for `target`, else None and why (one clause)."""
    from localspec.models.gguf_header import read_header

    if draft is None or getattr(draft, "arch", None) != EAGLE3_ARCH or getattr(target, "path", None) is None:
        return None, f"the EAGLE-3 drafter is a draft model's GGUF (general.architecture {EAGLE3_ARCH}): name it as " \
                     "the draft"
    why = layer_features_unsupported()
    if why is not None:
        return None, why
    try:
        return check_eagle3_drafter(read_header(target.path), read_header(draft.path)), ""  # type: ignore[attr-defined]
    except LocalspecError as exc:
        return None, str(exc)


def unavailable(target: ScoringModel, draft: ScoringModel | None = None) -> str | None:
    """Why these models have no EAGLE-3 drafter (one clause), None when they have one."""
    facts, why = facts_of(target, draft)
    return None if facts is not None else why


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: an EAGLE-3 drafter where the draft is one for this target."""
    facts, _ = facts_of(target, draft)
    return None if facts is None else Eagle3Drafter(target, draft, facts)  # type: ignore[arg-type]

