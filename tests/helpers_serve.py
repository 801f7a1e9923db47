"""Shared by the server tests: the demo pair's files, and a stop string that lands inside an accepted draft run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localspec import demo
from localspec.engine import DoneEvent, Engine, TokenEvent
from localspec.session import ModelFiles

PROMPT = "The three primary colours are"
# SmolLM2's `<gh_stars>`, `<issue_start>`, `<issue_comment>`: control tokens the tiny pair names as its FIM
# prefix, suffix and middle markers (SmolLM2 itself has none).
FIM_TOKENS = (7, 8, 9)


def demo_files(home: Path) -> ModelFiles:
    folder = home / "cache" / "demo"
    return ModelFiles(target=folder / demo.TARGET_FILE, draft=folder / demo.DRAFT_FILE, name="demo")


@dataclass(frozen=True)
class StopInRun:
    text: str  # the whole greedy completion
    stop: str  # starts inside one accepted draft token and ends inside a later one of the same run
    cut: int  # where the stop starts in `text`
    tokens_through_stop: int  # tokens generated up to the one that completes the stop
    returned_tokens: int  # tokens whose text starts before the cut
    returned_from_draft: int


def find_stop_in_draft_run(engine: Engine, prompt: list[int], sampling, drafting, n: int) -> StopInRun:
    """Generate once (greedy: the server will generate the same), then pick a stop inside a run of >= 3 accepted
    draft tokens: from the middle of the run's 2nd token to the middle of its 3rd."""
    events = [e for e in engine.generate(prompt, sampling, drafting, n) if not isinstance(e, DoneEvent)]
    assert all(isinstance(e, TokenEvent) for e in events)
    texts = [e.text for e in events]
    starts = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    full = "".join(texts)
    for i in range(len(events) - 2):
        run = events[i : i + 3]
        if not all(e.from_draft for e in run) or any(len(e.text) < 2 for e in run[1:]):
            continue
        second, third = texts[i + 1], texts[i + 2]
        begin = starts[i + 1] + len(second) // 2
        end = starts[i + 2] + len(third) // 2  # exclusive, so the stop ends inside the 3rd token
        stop = full[begin:end]
        if not stop.strip() or full.find(stop) != begin:
            continue
        returned = sum(1 for s in starts if s < begin)
        return StopInRun(text=full, stop=stop, cut=begin, tokens_through_stop=i + 3, returned_tokens=returned,
                         returned_from_draft=sum(e.from_draft for e in events[:returned]))
    raise AssertionError(f"no run of 3 accepted draft tokens in {full!r}")
