"""Drafters: who proposes the tokens the target verifies. The protocol is in `base`; every other module here is one
drafter, registered under its row of `config.DRAFTER_TABLE` (its name there is what `[draft] drafter`, `--drafter`
and the server's `speculative.type` select). A new drafter is one file plus its table row: a class with the
`base.Drafter` methods and a `build(target, draft, built)` factory (None where these models cannot host it);
optionally `NEEDS` (drafters built before it, handed in `built`), `LLAMA_SERVER_TYPE` (its `speculative.type` as
llama-server spells it) and `unavailable(target, draft)` (why these models have none, for the error that names it).
The row holds what the layers below the engine read without importing the file (title, needs a draft model, reads
the target)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from localspec.config import DRAFTER_TABLE
from localspec.drafters.base import Drafter
from localspec.rounds.scores import ScoringModel

Factory = Callable[[ScoringModel, ScoringModel | None, dict[str, Drafter]], Drafter | None]


def _in_build_order() -> dict[str, ModuleType]:
    """Every drafter of the table (`config.DRAFTER_TABLE`: name → module), each after those it `NEEDS`."""
    modules = {name: importlib.import_module(DRAFTER_TABLE[name].module) for name in sorted(DRAFTER_TABLE)}
    ordered: dict[str, ModuleType] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in ordered:
            return
        if name in chain or name not in modules:
            raise ImportError(f"{DRAFTER_TABLE[chain[-1]].module} needs {name!r}, "
                              + ("which needs it back" if name in chain else "which is no drafter"))
        for needed in getattr(modules[name], "NEEDS", ()):
            visit(needed, (*chain, name))
        ordered[name] = modules[name]

    for name in modules:
        visit(name, ())
    return ordered


_MODULES = _in_build_order()
# name → factory(target, draft model or None, the drafters built before it); None: unavailable with these models.
REGISTRY: dict[str, Factory] = {name: module.build for name, module in _MODULES.items()}
# llama-server's `speculative.type` spellings of the drafters that have one.
LLAMA_SERVER_TYPES: dict[str, str] = {module.LLAMA_SERVER_TYPE: name for name, module in _MODULES.items()
                                      if getattr(module, "LLAMA_SERVER_TYPE", None)}


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
    than "these models cannot run it" applies): the drafter's own `unavailable(target, draft)` where it has one."""
    module = _MODULES.get(name)
    why = getattr(module, "unavailable", None)
    return (why(target, draft) or "") if why is not None else ""
