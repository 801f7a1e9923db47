"""Drafters: who proposes the tokens the target verifies. The protocol is in `base`; one file per drafter; a line
here registers it under the name `[draft] drafter` (and the server's `speculative.type`) selects."""

from __future__ import annotations

from collections.abc import Callable

from localspec.drafters import chain, lookup, model, mtp
from localspec.drafters.base import Drafter
from localspec.scores import ScoringModel

Factory = Callable[[ScoringModel, ScoringModel | None, dict[str, Drafter]], Drafter | None]

# name → factory(target, draft model or None, the drafters built before it); None: unavailable with these models.
REGISTRY: dict[str, Factory] = {
    "lookup": lookup.build,
    "model": model.build,
    "chain": chain.build,  # after both of its parts
    "mtp": mtp.build,  # the target's own MTP head (a model that has one)
}


def build(target: ScoringModel, draft: ScoringModel | None) -> dict[str, Drafter]:
    """Every drafter these models allow, by name."""
    built: dict[str, Drafter] = {}
    for name, factory in REGISTRY.items():
        made = factory(target, draft, built)
        if made is not None:
            built[name] = made
    return built
