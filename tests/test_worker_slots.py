"""The worker's llama-server extras, in process on the tiny pair with two slots: `id_slot` pins a job to a slot
(it waits for that slot while the jobs behind it go ahead), `submit_all` queues a request's choices all or none,
and /slots' and /metrics' figures (slot views, totals) match what the jobs returned. Each output is checked
against the same request generated alone in a one-slot engine."""

from __future__ import annotations

import queue
import time

import pytest

from localspec.config import load_preset
from localspec.rounds.events import collect
from localspec.server.errors import ApiError
from localspec.server.worker import Delta, Finished, Job, Worker
from localspec.sessions.session import ModelFiles, open_session

pytestmark = pytest.mark.slow

# One thread: a load skips the automatic choice's 0.2 s CPU sample, and two test workers never split a core.
GREEDY = load_preset("greedy").with_overrides(n_ctx=512, threads=1)
PROMPTS = [[1000 + i for i in range(12)], [2000 + i for i in range(9)], [3000 + i for i in range(15)]]


def alone(pair, prompt: list[int], n: int) -> list[int]:
    with open_session(ModelFiles(target=pair[0], draft=pair[1], name="test"), GREEDY) as s:
        return collect(s.engine.generate(prompt, GREEDY.sampling, GREEDY.draft, n)).tokens


def test_pinned_jobs_wait_for_their_slot_while_others_go_ahead(tiny_pair):
    with open_session(ModelFiles(target=tiny_pair[0], draft=tiny_pair[1], name="test"), GREEDY, parallel=2) as s:
        worker = Worker(s.engine, queue_size=4)
        worker.start()
        try:
            ends: queue.Queue = queue.Queue()
            order: list[str] = []

            def job(name: str, prompt: list[int], n: int, slot: int | None) -> Job:
                def sink(item) -> None:
                    if isinstance(item, Delta) and name not in order:
                        order.append(name)  # the first text of each job: the order they started in
                    elif not isinstance(item, Delta):
                        ends.put((name, item))

                return Job(prompt=prompt, sampling=GREEDY.sampling, drafting=GREEDY.draft, max_tokens=n, stops=(),
                           sink=sink, slot=slot)

            first, pinned, free = job("first", PROMPTS[0], 60, 0), job("pinned", PROMPTS[1], 8, 0), \
                job("free", PROMPTS[2], 8, None)
            worker.submit(first)
            deadline = time.monotonic() + 120
            while "first" not in order and time.monotonic() < deadline:
                time.sleep(0.02)
            worker.submit_all([pinned, free])  # pinned waits for slot 0; free takes slot 1 at once
            results = {}
            for _ in range(3):
                name, item = ends.get(timeout=300)
                assert isinstance(item, Finished), item
                results[name] = item.result
            assert order.index("free") < order.index("pinned")
            assert (results["first"].slot, results["pinned"].slot, results["free"].slot) == (0, 0, 1)
            views = worker.slot_views()
            assert [v.task_id for v in views] == [pinned.task_id, free.task_id] and not any(v.busy for v in views)
            assert views[0].stats.tokens == results["pinned"].stats.tokens
            assert views[0].n_tokens >= len(PROMPTS[1]) + results["pinned"].stats.tokens - 1
            totals = worker.stats.totals
            assert totals.tokens == sum(r.stats.tokens for r in results.values())
            assert totals.accepted == sum(r.stats.accepted for r in results.values())
            texts = {name: s.target.detokenize(alone(tiny_pair, p, n)) for name, p, n in
                     (("first", PROMPTS[0], 60), ("pinned", PROMPTS[1], 8), ("free", PROMPTS[2], 8))}
            assert {name: r.text for name, r in results.items()} == texts
            # all of a request's choices, or none of them
            with pytest.raises(ApiError, match="busy"):
                worker.submit_all([job(f"c{i}", PROMPTS[0], 2, None) for i in range(7)])
            assert worker.queued == 0
        finally:
            worker.shutdown(timeout=60)
