"""How long the drafts are: the per-stream draft-length policy and the batch-size load policy.

The loop asks these once per round (`Engine._plan`, the one place k is decided) and tells them what the round
measured; neither knows which drafter runs.
"""

from __future__ import annotations

import numpy as np

from localspec.config import Drafting


class DraftLength:
    """Chooses k for the next round: fixed, or adaptive among a few lengths that it changes rarely.

    On CUDA every change of the verify width costs: llama.cpp rebuilds its compute graph and the CUDA graph runs
    uncaptured for two calls, then is captured again (docs/gpu.md: widths 7,7,5,5 cost 23.0 ms a call against
    19.0 for 7 and 15.7 for 5). So adaptive drafting holds k for EPOCH rounds and considers only a short LADDER
    of lengths (a third, two thirds and all of the preset's k). At an epoch's end it moves to the length that
    maximises expected tokens per second, E[tokens | k] / cost(k), and only if that beats the current length
    by MIN_GAIN. Acceptance is bursty, so E[tokens | k] = 1 + sum_{i<=k} S(i) uses the measured survival
    S(i) = P(positions 1..i all accepted) from each position's conditional acceptance; a position never
    verified borrows the deepest measured rate. cost(k) = k draft steps + a verify of k + 1 tokens, both timed
    online (the verify cost of an untried width from a line through the tried ones). The first two epochs probe
    the longest and the middle length, since a line needs two widths.
    """

    EPOCH = 16
    MIN_GAIN = 1.05

    def __init__(self, cfg: Drafting) -> None:
        self.k_max = cfg.n_draft
        self.ladder = sorted({max(1, round(self.k_max * f)) for f in (1 / 3, 2 / 3, 1.0)})
        self.adaptive = cfg.adaptive and len(self.ladder) > 1
        self.k = self.k_max
        self.rounds = 0
        self.tried = np.zeros(self.k_max + 1)  # index i: rounds that verified position i
        self.ok = np.zeros(self.k_max + 1)
        self.draft_step_s = 0.0
        self.verify_s: dict[int, float] = {}

    def next(self) -> int:
        if self.adaptive and self.rounds and self.rounds % self.EPOCH == 0:
            self.k = self._choose()
        return self.k

    def _choose(self) -> int:
        if len(self.verify_s) < 2:
            return self.ladder[len(self.ladder) // 2] if self.k == self.k_max else self.k_max
        rate = 0.8  # prior for a position never verified
        survival, expected = 1.0, [1.0]
        for i in range(1, self.k_max + 1):
            if self.tried[i] >= 1.0:
                rate = (self.ok[i] + 1.0) / (self.tried[i] + 2.0)
            survival *= rate
            expected.append(expected[-1] + survival)
        speed = {k: expected[k] / (k * self.draft_step_s + self._verify_cost(k + 1)) for k in self.ladder}
        best = max(speed, key=speed.__getitem__)
        return best if speed[best] > self.MIN_GAIN * speed.get(self.k, 0.0) else self.k

    def _verify_cost(self, width: int) -> float:
        if width in self.verify_s:
            return self.verify_s[width]
        widths = np.array(sorted(self.verify_s))
        times = np.array([self.verify_s[w] for w in widths])
        slope, intercept = np.polyfit(widths, times, 1)
        return float(max(intercept + slope * width, times.min()))

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, width: int) -> None:
        self.rounds += 1
        if not self.adaptive:
            return
        if self.rounds % self.EPOCH == 0:  # older epochs count less: acceptance drifts with the text
            self.tried *= 0.5
            self.ok *= 0.5
        verified = min(accepted + 1, drafted)  # positions 1..accepted passed; the next one (if drafted) failed
        self.tried[1 : verified + 1] += 1.0
        self.ok[1 : accepted + 1] += 1.0
        ema = 0.2
        if drafted:
            step = draft_s / drafted
            self.draft_step_s = step if self.draft_step_s == 0.0 else (1 - ema) * self.draft_step_s + ema * step
        old = self.verify_s.get(width)
        self.verify_s[width] = verify_s if old is None else (1 - ema) * old + ema * verify_s


class LoadPolicy:
    """How much of its draft length each stream drafts at the current batch size (several slots in one round).

    With many slots the target's verify grows towards compute-bound and draft tokens cost nearly what they save.
    So per batch size this measures the aggregate tokens per second of whole rounds at each share of the streams'
    own draft lengths in SHARES (all of it, none: plain batched decoding, half), an epoch each, then uses the
    fastest and re-measures the others in turn every REPROBE-th epoch (acceptance drifts with the text). One slot
    alone always drafts all of it: the single-request loop (and `localspec bench`'s modes) stays what it was, and
    a seed reproduces its output.
    """

    EPOCH = 8
    REPROBE = 8
    SHARES = (1.0, 0.0, 0.5)

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}
        self.rate: dict[tuple[int, float], float] = {}  # (batch size, share) -> smoothed tokens per second

    def share(self, n: int) -> float:
        """The share of each stream's draft length to draft this round, with n streams in it."""
        if n < 2:
            return 1.0
        epoch = self.rounds.get(n, 0) // self.EPOCH
        if epoch < len(self.SHARES):
            return self.SHARES[epoch]
        best = max(self.SHARES, key=lambda f: self.rate.get((n, f), 0.0))
        if epoch % self.REPROBE:
            return best
        others = [f for f in self.SHARES if f != best]
        return others[(epoch // self.REPROBE) % len(others)]

    def observe(self, n: int, share: float, tokens: int, seconds: float) -> None:
        if n < 2 or seconds <= 0.0:
            return
        self.rounds[n] = self.rounds.get(n, 0) + 1
        rate, key = tokens / seconds, (n, share)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else 0.8 * old + 0.2 * rate

    def summary(self) -> dict[int, dict[str, float]]:
        """Per batch size seen: the measured tok/s at each share of the draft length ("k×1", "k×0.5", "k×0": plain),
        for the server's /health."""
        return {n: {f"k×{f:g}": round(r, 1) for (m, f), r in sorted(self.rate.items()) if m == n}
                for n in sorted(self.rounds)}
