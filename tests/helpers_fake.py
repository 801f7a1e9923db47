"""A scripted stand-in for `llama.model.LlamaModel` (the `scores.ScoringModel` protocol): the loop's fast lane.

The model is a second-order Markov chain: the logits after a position depend on the last two tokens only, from a
seeded table, so the exact distribution of any continuation is known in closed form (`FakeModel.next_probs`) and a
sequence scores the same in any batch. Its KV cells are bookkeeping it checks: a decode must start exactly where
the sequence's cells end, so a missed rewind fails at once. A draft for it is the same table plus noise.

With `rewind_depth` it rewinds like a recurrent state in llama.cpp (`LlamaModel.truncate`): exactly only within
its last decode and that many tokens, once per decode; further back to its checkpoint or to nothing, saying how
many cells it kept, so a caller that does not decode the rest again fails the position check at its next decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from localspec.config import Sampling
from localspec.rounds.sampling import candidates
from localspec.rounds.scores import DeviceDist, Scores


class FakeModel:
    def __init__(self, vocab: int = 8, *, seed: int = 0, scale: float = 2.5, noise: float = 0.0,
                 noise_seed: int = 1, n_ctx: int = 512, n_seq: int = 1, device_top_k: int = 0,
                 eog: int | None = None, rewind_depth: int | None = None, recurrent: bool = False,
                 window: int = 0) -> None:
        table = np.random.default_rng(seed).normal(0.0, scale, size=(vocab, vocab, vocab))
        if noise:
            table = table + np.random.default_rng(noise_seed).normal(0.0, noise, size=table.shape)
        self.table = table.astype(np.float32)
        self.n_vocab = vocab
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_batch = 64
        self.on_gpu = False
        self.batches_sequences = True
        self.sequence_batch_error = self.width_noise = 0.0  # what the load-time probe reports (bit for bit)
        self.batch_warning: str | None = None  # ... and its /health line where the width noise defeats speculation
        self.device_top_k = device_top_k
        self.unknown_token = 0
        self.eog = eog
        self.add_bos = False
        # What a saved state may serve (`restore_floor`): a recurrent model none of its prefixes; a sliding window
        # of `window` tokens: its state keeps only that many last positions (the rest restore as missing, -1).
        self.recurrent = recurrent or rewind_depth is not None
        self.window = window
        self.cells: dict[int, list[int]] = {}
        self.floors: dict[int, int] = {}  # per sequence restored from a state: how short it may be cut back (checked)
        self.loads = 0  # states restored
        self.decodes = 0
        self.rewind_depth = rewind_depth
        self._last: dict[int, int] = {}  # recurrent: each sequence's tokens in its last decode
        self._pending: set[int] = set()  # ... a rollback not yet decoded past
        self._saved: dict[int, int] = {}  # ... its checkpoint's length
        self.restores = 0  # rewinds that went back to a checkpoint or to nothing (recurrent)
        self._modes: dict[int, Any] = {}
        self._draws: dict[int, np.random.Generator] = {}
        # Sequences whose decodes return a hidden state after each token (`want_hidden`): here the logits after it,
        # so a drafter fed them (the target-rows hook) is checked against what the target computed there.
        self._hidden: set[int] = set()

    # -- what the loop calls ------------------------------------------------------------------------------------

    def logits_after(self, context: Sequence[int]) -> np.ndarray:
        a = context[-2] if len(context) > 1 else 0
        return self.table[a, context[-1]]

    def decode(self, tokens: Sequence[int], start_pos: int, all_logits: bool = False, seq: int = 0) -> Scores | None:
        return self.decode_many([(seq, tokens, start_pos, all_logits)])[0]

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        self.decodes += 1
        out: list[Scores | None] = []
        for seq, tokens, start, all_logits in items:
            cells = self.cells.setdefault(seq, [])
            assert start == len(cells), f"sequence {seq}: decode at {start}, but its cells end at {len(cells)}"
            assert all(0 <= t < self.n_vocab for t in tokens), tokens
            cells.extend(tokens)
            self._last[seq] = len(tokens)
            self._pending.discard(seq)
            assert len(cells) <= self.n_ctx
            if not tokens:
                out.append(None)
                continue
            first = len(cells) - (len(tokens) if all_logits else 1)
            seen = cells[max(0, first - self.window + 1) :] if self.window else cells  # what the rows attend to
            assert -1 not in seen, f"sequence {seq} attends to a cell its restored state lacks"
            rows = np.stack([self.logits_after(cells[: i + 1]) for i in range(first, len(cells))])
            scores = self._as_mode(rows, seq)
            if seq in self._hidden:
                hidden = np.stack([self.logits_after(cells[: i + 1]) for i in range(len(cells) - len(tokens),
                                                                                    len(cells))])
                scores = dataclasses.replace(scores, hidden=hidden)
            out.append(scores)
        return out

    def truncate(self, n_keep: int, seq: int = 0) -> int:
        floor = self.floors.get(seq, 0)
        assert n_keep == 0 or n_keep >= floor, f"sequence {seq}: cut to {n_keep}, below its restored floor {floor}"
        if n_keep == 0:
            self.floors.pop(seq, None)
        cells = self.cells.setdefault(seq, [])
        if self.rewind_depth is None or n_keep >= len(cells):
            del cells[n_keep:]
            return n_keep
        back = len(cells) - n_keep
        if n_keep > 0 and back <= min(self.rewind_depth, self._last.get(seq, 0) - 1) and seq not in self._pending:
            self._pending.add(seq)
            kept = n_keep
        else:
            saved = self._saved.get(seq)
            kept = saved if saved is not None and saved <= n_keep else 0
            self._pending.discard(seq)
            self._last.pop(seq, None)
            self.restores += 1
        del cells[kept:]
        if self._saved.get(seq, 0) > kept:
            del self._saved[seq]
        return kept

    def checkpoint(self, seq: int = 0) -> None:
        if self.rewind_depth is not None:
            self._saved[seq] = len(self.cells.get(seq, []))

    def want_hidden(self, seq: int, on: bool) -> None:
        (self._hidden.add if on else self._hidden.discard)(seq)

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            self.cells.clear()
            self.floors.clear()
            self._saved.clear()
            self._pending.clear()
            self._last.clear()
        else:
            self.cells.pop(seq, None)
            self.floors.pop(seq, None)
            self._forget(seq)

    def _forget(self, seq: int) -> None:
        """A recurrent sequence's snapshots and checkpoint no longer follow from its cells."""
        self._saved.pop(seq, None)
        self._pending.discard(seq)
        self._last.pop(seq, None)

    def save_state(self, seq: int = 0) -> bytearray:
        cells = self.cells.get(seq, [])
        if self.window and len(cells) > self.window:  # as llama.cpp: the positions before the window are not saved
            cells = [-1] * (len(cells) - self.window) + cells[-self.window :]
        return bytearray(np.array(cells, dtype=np.int32).tobytes())

    def load_state(self, data: bytearray, seq: int = 0) -> bool:
        self.cells[seq] = np.frombuffer(bytes(data), dtype=np.int32).tolist()
        self.floors[seq] = self.restore_floor(len(self.cells[seq]))
        self._forget(seq)
        self.loads += 1
        return True

    def restore_floor(self, n_tokens: int) -> int:
        if self.recurrent:
            return n_tokens
        return n_tokens - 1 if self.window and n_tokens > self.window else 0

    def use_device_sampler(self, mode: Any, seq: int = 0) -> bool:
        if not self.device_top_k:
            mode = None
        if mode is None:
            self._modes.pop(seq, None)
        else:
            self._modes[seq] = mode
        return mode is not None

    def full_row(self, token: int, pos: int, seq: int = 0) -> np.ndarray:
        self.truncate(pos, seq)
        self.decodes += 1
        cells = self.cells.setdefault(seq, [])
        cells.append(token)
        return self.logits_after(cells).astype(np.float32)

    def restart_device_sampler(self, seq: int = 0) -> None:
        mode = self._modes.get(seq)
        if isinstance(mode, DeviceDist):
            self._draws[seq] = np.random.default_rng(mode.seed)

    def piece(self, token: int, special: bool = False) -> bytes:
        return f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    # -- references ------------------------------------------------------------------------------------------

    def next_probs(self, context: Sequence[int], sampling: Sampling) -> dict[int, float]:
        """The exact distribution of the next token under `sampling`'s pipeline (no penalties)."""
        dist = candidates(self.logits_after(context)[None, :].astype(np.float32), sampling)
        return dict(zip(dist.ids[0].tolist(), dist.probs[0].tolist(), strict=True))

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """Plain greedy decoding straight from the table: a reference that shares no code with the loop."""
        context = list(prompt)
        for _ in range(n):
            context.append(int(np.argmax(self.logits_after(context))))
        return context[len(prompt):]

    def _as_mode(self, rows: np.ndarray, seq: int) -> Scores:
        mode = self._modes.get(seq)
        if mode is None:
            return Scores(rows)
        if mode == "greedy":
            return Scores(np.zeros((len(rows), 1), np.float32), ids=np.argmax(rows, axis=1)[:, None])
        if mode == "top_k":
            k = min(self.device_top_k, self.n_vocab)
            ids = np.argsort(-rows, axis=1, kind="stable")[:, :k]
            return Scores(np.take_along_axis(rows, ids, axis=1), ids=ids)
        assert isinstance(mode, DeviceDist)
        cfg = Sampling(mode.temperature, mode.top_k, mode.top_p, mode.min_p, 1.0, 0, 0.0, 0.0, mode.seed)
        dist = candidates(rows, cfg)
        rng = self._draws.setdefault(seq, np.random.default_rng(mode.seed))
        return Scores(None, drawn=np.array([dist.sample(r, rng) for r in range(len(rows))]))


class Clock:
    """A fake `time` module's perf_counter: decodes advance it by what a machine would take (no timed test)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def install(self, monkeypatch: Any) -> Clock:
        """Be the clock of the loop, its streams and the model drafter (a pytest monkeypatch undoes it)."""
        import types

        from localspec.drafters import model
        from localspec.rounds import engine, stream

        timing = types.SimpleNamespace(perf_counter=self.perf_counter)
        for module in (engine, stream, model):
            monkeypatch.setattr(module, "time", timing)
        return self


class TimedFake(FakeModel):
    """A fake whose decodes take `base` + `per_token` seconds per token on the fake clock."""

    def __init__(self, clock: Clock, base: float, per_token: float, **fake: object) -> None:
        super().__init__(**fake)  # type: ignore[arg-type]
        self.clock, self.base, self.per_token = clock, base, per_token

    def decode_many(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[Scores | None]:
        self.clock.now += self.base + self.per_token * sum(len(tokens) for _, tokens, _, _ in items)
        return super().decode_many(items)


def draft_policy(cfg: Any, cost: Any = None, padded: bool = False) -> Any:
    """A stream's draft-length policy for the drafting settings `cfg`, with its drafter's cost rules attached as the
    engine attaches them (`Drafter.pricing`; the drafters are built on fake models that never run)."""
    from localspec import drafters
    from localspec.rounds.policies import DraftCost, DraftLength

    cost = cost if cost is not None else DraftCost(cfg.n_draft)
    drafter = drafters.build(FakeModel(), FakeModel())[cfg.drafter]
    return DraftLength(cfg, cost, padded, drafter.pricing(cost, cfg))
