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
    """Every drafter these models allow, by name. A factory that hands back a drafter built before under another
    name (the chain without a draft model is lookup alone) adds no name: asked for by that name, the request would
    silently get another drafter."""
    built: dict[str, Drafter] = {}
    for name, factory in REGISTRY.items():
        made = factory(target, draft, built)
        if made is not None and all(made is not other for other in built.values()):
            built[name] = made
    return built


def unavailable(name: str, target: ScoringModel, draft: ScoringModel | None) -> str:
    """Why `build` offers no drafter `name` with these models, as one clause ("" where nothing more specific
    than "these models cannot run it" applies)."""
    if name == "mtp":
        return mtp.unavailable(target) or ""
    return "no draft model is loaded" if draft is None else ""
