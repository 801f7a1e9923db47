"""Driving several generations through one engine round by round, as the server's worker does."""

from __future__ import annotations

from collections.abc import Sequence

from localspec.rounds.engine import Engine, Stream
from localspec.rounds.events import DoneEvent, TokenEvent, collect


def each_alone(engine: Engine, requests: Sequence[dict]) -> list[list[int]]:
    """Each request's tokens generated alone from empty caches, one after another in `engine`: the reference that
    `run_together`'s results are held to."""
    out = []
    for request in requests:
        engine.reset()
        out.append(collect(engine.generate(**request)).tokens)
    return out


def run_together(engine: Engine, requests: Sequence[dict], arrivals: Sequence[int],
                 slots: Sequence[int] | None = None, stop_after: dict[int, int] | None = None) -> list[list[int]]:
    """Start request i at round arrivals[i] in the slot the engine picks (or slots[i]); step all running streams
    together until every one has finished. `stop_after`: request -> after how many of its tokens its caller asks it
    to stop. Returns each request's tokens."""
    out: list[list[int]] = [[] for _ in requests]
    running: dict[int, Stream] = {}
    done: set[int] = set()
    stop_after = stop_after or {}
    round_no = 0
    while len(done) < len(requests):
        for i, request in enumerate(requests):
            if arrivals[i] == round_no:
                slot = engine.free_slot(request["prompt"]) if slots is None else slots[i]
                assert slot is not None
                stop = (lambda i=i: len(out[i]) >= stop_after[i]) if i in stop_after else None
                running[i] = engine.start(**request, slot=slot, should_stop=stop)
        engine.step(list(running.values()))
        for i, stream in list(running.items()):
            for event in stream.events():
                if isinstance(event, TokenEvent):
                    out[i].append(event.token)
                else:
                    assert isinstance(event, DoneEvent)
                    done.add(i)
                    del running[i]
        round_no += 1
        assert round_no < 10_000
    return out
