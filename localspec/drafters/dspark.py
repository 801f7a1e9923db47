"""The DSpark drafter: a DFlash block drafter whose GGUF carries DSpark's Markov head (and a confidence head), run by
`dflash.BlockDrafter` (docs/dflash.md); its own module so that `--drafter dspark` names it (the registry builds
one drafter per module's factory, and each factory builds only its kind)."""

from __future__ import annotations

from localspec.drafters.base import Drafter
from localspec.drafters.dflash import BlockDrafter, facts_of
from localspec.rounds.scores import ScoringModel

LLAMA_SERVER_TYPE = "draft-dspark"  # its `speculative.type` (llama-server's name)


def unavailable(target: ScoringModel, draft: ScoringModel | None = None) -> str | None:
    """Why these models have no DSpark drafter (one clause), None when they have one."""
    facts, why = facts_of(target, draft, "dspark")
    return None if facts is not None else why


def build(target: ScoringModel, draft: ScoringModel | None, built: dict[str, Drafter]) -> Drafter | None:
    """The registry's factory: a DSpark drafter where the draft is one for this target (`check_block_drafter`)."""
    facts, _ = facts_of(target, draft, "dspark")
    return None if facts is None else BlockDrafter(target, draft, facts)  # type: ignore[arg-type]
