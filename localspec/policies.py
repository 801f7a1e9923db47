"""How long the drafts are: the per-stream cost model and draft-length policy, and the batch-size load policy.

The loop asks these once per round (`Engine._plan`, the one place k is decided) and tells them what the round
measured; the chained drafter asks the same stream's policy how far the draft model should extend lookup's match.
Neither knows which drafter runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from localspec.config import Drafting


@dataclass(slots=True)
class _Tables:
    """What one observation of `DraftCost` implies, per source and per verify width: Python floats, read one by one
    by the questions every round asks (`best_ahead`, `best_continuation`: inside the loop, between decodes, each
    numpy call cost more than the arithmetic it did), and as arrays, made when first asked, by the vectorised
    ones (`_speeds`)."""

    survival: dict[str, list[float]]  # S(0..k_max)
    cumulative: dict[str, list[float]]  # 1 + S(1) + ... + S(i)
    verify: list[float]  # seconds of a verify of width 0..k_max + 1 (measured, else estimated)
    _arrays: tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray] | None = field(default=None)

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
        """(survival, cumulative, verify) as numpy arrays."""
        if self._arrays is None:
            self._arrays = ({s: np.array(v) for s, v in self.survival.items()},
                            {s: np.array(v) for s, v in self.cumulative.items()}, np.array(self.verify))
        return self._arrays


def _least_squares(points: Iterable[tuple[float, float]]) -> tuple[float, float, float | None]:
    """(mean x, mean y, the least-squares slope; None where the xs do not vary), in closed form: np.polyfit costs
    ~50 us a call, and the cost model asks inside the loop."""
    points = list(points)
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return mean_x, mean_y, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


class DraftCost:
    """What drafting costs and earns for one stream, measured online; which draft length is fastest.

    Measured each round: the seconds of a draft-model step (`observe`: steady steps only), the verify's seconds at
    its width (an untried width from a line through the tried ones; with one tried width, a prior slope), and per
    drafter source ("model":
    the draft model's tokens, "lookup": prompt lookup's, which are right far more often) each position's
    conditional acceptance, P(position i accepted | positions before it were). A round that drafts m lookup tokens
    then n model tokens yields E = 1 + sum of the survivals S(i) = P(positions 1..i all accepted) tokens and costs
    n draft steps + a verify of m + n + 1 tokens (or the padded width on a GPU); the best n maximises E / cost,
    and n = 0 is a plain step, whose cost (a one-token verify) is what one token is worth. Older rounds count less
    (acceptance drifts with the text): the model's counts halve every DECAY rounds of the stream, so a model not
    drafted for long drifts back to its prior rate; lookup's every DECAY rounds that proposed its tokens.

    It also keeps the probe schedule: while the draft model is judged a loss it is not run, so it could never be
    judged again; every `interval` such rounds one round drafts PROBE tokens with it (a cheap probe: a couple of
    draft steps). The interval starts at PROBE_FIRST (one adaptive epoch: a stale judgement is at most that old
    early on) and doubles each time a probe confirms the loss, up to PROBE_MAX (on a machine where the model never
    pays, probing then costs about 2 draft steps per 256 rounds, under 1%); it resets when the model pays again. A
    model that would lose even if every token were accepted (`could_pay`) goes to PROBE_MAX at once and is probed
    only in sync: no acceptance a probe measures could turn it on, only a change of its costs.
    When the draft model has sat out many rounds, a probe's first step must first read every token since, which
    on a CPU can cost far more than the probe itself: a due probe goes ahead out of sync only while catching up is
    affordable (`_catch_up_affordable`: unmeasured, the first such probe measures `catch_up_cost`; on a GPU it reads
    hundreds of tokens in a few ms), else it waits for a round where the model's cells are current (a
    generation's first round). (It used to wait 4 intervals before its first catch-up: on the H200 the chain then
    probed a model worth 1.9x plain once in 64 rounds, and sat at lookup's pace.) A model that could pay probes
    with all the room (`DraftLength.extension`). Lookup's tokens judged a loss are probed on the same schedule
    (`lookup_probe`), and meanwhile lookup does not search (`DraftLength.lookup_wanted`).
    """

    SOURCES = ("model", "lookup")
    PRIOR = {"model": 0.7, "lookup": 0.9}  # a position's acceptance before anything is measured there
    PRIOR_WEIGHT = 2.0  # ... worth this many rounds
    VERIFY_SLOPE = 0.25  # one tried width: an extra token costs this share of a 1-token verify (GPU ~0.17, CPU ~0.3)
    EMA = 0.2
    DECAY = 16
    PROBE_FIRST, PROBE_MAX, PROBE = 16, 256, 2
    CATCH_UP_SHARE = 0.05  # a probe out of sync may cost this share of the rounds it waited in catching up
    STEPS = 8  # recent rounds' steady step figures kept: the least is the step (a slow one-off call is no step)

    def __init__(self, k_max: int, graphs: bool = False) -> None:
        self.k_max = k_max
        self.graphs = graphs  # the target runs CUDA graphs: a verify width change costs a rebuild (see below)
        self.switch_s: float | None = None  # measured excess seconds of the calls after one width change
        self._width = 0  # the last verify's width
        self._since_change = 0  # verifies at this width since it changed
        self._excess = 0.0
        self._measurable = False
        self.rounds = 0
        # index i: rounds that verified position i (Python floats: counted every round, read by `_survival`)
        self.tried = {s: [0.0] * (k_max + 1) for s in self.SOURCES}
        self.ok = {s: [0.0] * (k_max + 1) for s in self.SOURCES}
        self.seen = dict.fromkeys(self.SOURCES, 0)  # rounds that verified a token of the source
        self._aged = dict.fromkeys(self.SOURCES, 0)  # per source: the DECAY epoch of rounds its counts were aged to
        self.step_s: float | None = None  # seconds per draft-model step: the least of the recent steady ones
        self._steps: deque[float] = deque(maxlen=self.STEPS)
        # The share of model tokens drafted ahead (beside the last verify: no draft steps on the critical path);
        # a round's draft steps cost that much less on average, which long drafts earn most. (Until the bet model
        # below has measured a draft-ahead: then it replaces this average.)
        self.ahead = 0.0
        # Draft-ahead's bet model (`_ahead_terms`): a bet is kept when every draft was accepted (S(k)) and the
        # draft's argmax guess of the target's own token came true (`guess_rate`, measured over the bets that
        # could: their round accepted every draft); a decode beside the verify costs `ahead_step_s` (contended);
        # the ahead thread ends `ahead_lag_s` later than its decodes alone would beside a verify that starts with
        # it (thread start, the GIL: on the H200 2.3 ms), so the loop waits max(0, lag + decodes x step - verify).
        self.bets, self.bets_kept = 0.0, 0.0
        self.ahead_step_s: float | None = None
        self.ahead_lag_s: float | None = None
        self._ahead_s: float | None = None  # the last draft-ahead's seconds (`observe_ahead`), for the lag
        self._ahead_steps: deque[float] = deque(maxlen=self.STEPS)  # recent bets' seconds a decode
        self.aheads = 0  # draft-aheads told (`observe_ahead`): the first is cold and measures nothing
        self._ahead_round: int | None = None  # the round the ahead figures were last measured in
        self._ahead_stale = False  # this round's draft-ahead comes after a pause: its figures replace the old
        self.model_rounds = 0  # rounds that drafted with the model (its step cost is known after one)
        self.last_model_round = 0
        self.verify_s: dict[int, float] = {}
        self.verified: dict[int, int] = {}  # per width: the round its verify was last measured
        self.idle = 0  # rounds the model sat out since it last drafted (judged a loss)
        self.model_on = True  # the model alone was last judged to pay (`DraftLength.extension`'s hysteresis)
        self.interval = self.PROBE_FIRST
        self.lookup_idle, self.lookup_interval = 0, self.PROBE_FIRST  # likewise for lookup's tokens
        self.lookup_off = False  # lookup's tokens were last judged a loss: it does not search (`lookup_wanted`)
        self.lookup_short = 0  # rounds in a row that proposed only some of lookup's match (`lookup_length`)
        # Catching up, measured on probes out of sync: (tokens the model had sat out, the excess of the probe's first
        # step over a steady step), the recent ones (`catch_up_cost`); `_probe_lag`: the one issued this round's lag.
        self.catch_ups: deque[tuple[int, float]] = deque(maxlen=self.STEPS)
        self._probe_lag = 0
        self._tables: _Tables | None = None  # what the last observation implies, computed once when first asked
        self.ahead_fit = False  # the stream drafts ahead only what fits beside the verify (`best_ahead`)

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, width: int,
                looked_up: int = 0, first_s: float | None = None, ahead: int = 0,
                wait_s: float | None = None, least_s: float | None = None) -> None:
        """One round: `drafted` tokens, the first `looked_up` from prompt lookup and the rest from the model (which
        took `draft_s`, its first step `first_s`: None if unknown, the least of its later steps `least_s`; `ahead`
        of them were drafted beside the last verify, off the path), of which `accepted` were; the verify of `width`
        tokens took `verify_s`, then the loop waited `wait_s` for the draft-ahead beside it (None: none ran)."""
        self.rounds += 1
        self._tables = None
        verified = min(accepted + 1, drafted)  # positions 1..accepted passed; the next one (if drafted) failed
        for source, (tried, ok) in (("lookup", (min(verified, looked_up), min(accepted, looked_up))),
                                    ("model", (max(0, verified - looked_up), max(0, accepted - looked_up)))):
            if not tried:
                continue
            self.seen[source] += 1
            # The model's counts age with the stream's rounds, so a probe after a pause is not weighed against
            # rejections long past; lookup's with its own (aged towards its 0.9 prior, every probe re-enabled a
            # lookup right 1 time in 5). docs/performance.md, the seventh run.
            epoch = self.rounds // self.DECAY if source == "model" else self.seen[source] // self.DECAY
            halvings, self._aged[source] = epoch - self._aged[source], epoch
            if halvings:
                scale = 0.5 ** halvings  # (underflows to 0.0 after a very long pause: the prior alone)
                self.tried[source] = [n * scale for n in self.tried[source]]
                self.ok[source] = [n * scale for n in self.ok[source]]
            counts, hits = self.tried[source], self.ok[source]
            for i in range(1, tried + 1):
                counts[i] += 1.0
            for i in range(1, ok + 1):
                hits[i] += 1.0
        from_model = drafted - looked_up
        on_path = from_model - ahead  # the model's tokens drafted in this round, not beside the last verify
        if from_model > 0:
            self.ahead = (1 - self.EMA) * self.ahead + self.EMA * (ahead / from_model)
        if on_path > 0 and draft_s > 0.0:  # (0 s: drafted ahead, beside the last verify: no step measured)
            # A step after the first: the first also reads what the model had not seen (a catch-up after sitting
            # out, lookup's drafts) and may capture a CUDA graph; a one-step round stands in until one is measured.
            # The least of them: on CUDA the two after the catch-up's width change run uncaptured (a probe's
            # average was 2.6-2.8 ms on the H200 where a step is 1.35, and judged the model a loss).
            if least_s is not None:
                steady: float | None = least_s
            elif first_s is None:
                steady = draft_s / on_path
            else:
                steady = (draft_s - first_s) / (on_path - 1) if on_path > 1 else None
            # A step measured after a long pause (a probe) replaces the old figures: the machine may have changed.
            if self.rounds - self.last_model_round > self.DECAY:
                self._steps.clear()
            if steady is not None or not self._steps:
                self._steps.append(draft_s / on_path if steady is None else steady)
            self.step_s = min(self._steps)
            self.model_rounds += 1
            self.last_model_round = self.rounds
            if self._probe_lag and first_s is not None:
                self.catch_ups.append((self._probe_lag, max(0.0, first_s - self.step_s)))
        self._probe_lag = 0
        if wait_s is not None and self._ahead_s is not None:
            # Waited: the ahead thread ended `wait_s` after the verify, so it lagged wait + verify - its decodes.
            # Not waited: it ended before the verify did, which bounds the lag from above (a bound from one noisy
            # round moves the figure a step towards it, as a measurement does).
            lag = max(0.0, (wait_s if wait_s > self.WAITED else 0.0) + verify_s - self._ahead_s)
            old = None if self._ahead_stale else self.ahead_lag_s
            self._ahead_round = self.rounds
            if wait_s > self.WAITED:
                self.ahead_lag_s = lag if old is None else (1 - self.EMA) * old + self.EMA * lag
            elif old is not None:
                self.ahead_lag_s = (1 - self.EMA) * old + self.EMA * min(old, lag)
            elif self.ahead_lag_s is not None:  # stale: the bound replaces a larger old figure
                self.ahead_lag_s = min(self.ahead_lag_s, lag)
        self._ahead_s = None
        self._observe_verify(width, verify_s)

    WAITED = 1e-4  # a wait shorter than this (s) is the ahead thread's bookkeeping, not a wait for its decodes

    def observe_ahead(self, seconds: float, decodes: int, could_keep: bool, kept: bool) -> None:
        """The draft-ahead beside this round's verify: `decodes` draft decodes in `seconds`; whether its bet could
        come true (the round accepted every draft) and whether it did (the guess was the target's token too).
        Told before the round's `observe`."""
        self._tables = None
        self.aheads += 1
        # The stream's first draft-ahead is cold (the worker thread starts; on the H200 its first decodes may
        # capture a graph): its seconds are no step and no lag. Taken whole, one slow first bet made the model a
        # loss "even if every draft were accepted" and locked it out of the chain for good (docs/performance.md).
        cold = self.aheads == 1
        # After a pause (the model sat out) the figures are old: the next measurement replaces them, as a step
        # after a pause does, rather than moving them 20% (a wrong figure kept the model out for many probes).
        self._ahead_stale = self._ahead_round is None or self.rounds - self._ahead_round > self.DECAY
        self._ahead_s = None if cold else seconds
        if decodes and not cold:
            # The least of the recent bets' figures (two at least), as the step is: one slow bet (a call that
            # captured a graph, a busy moment) is no step, and taken whole it ruled the model out until a probe.
            if self._ahead_stale:
                self._ahead_steps.clear()
            self._ahead_steps.append(seconds / decodes)
            self.ahead_step_s = min(self._ahead_steps) if len(self._ahead_steps) > 1 else None
        if could_keep:
            self.bets += 1.0
            self.bets_kept += kept
            if self.bets >= 2 * self.DECAY:  # the guess rate drifts with the text too
                self.bets, self.bets_kept = self.bets / 2, self.bets_kept / 2

    @property
    def guess_rate(self) -> float:
        """P(the bet's guess of the target's own token is right | every draft was accepted)."""
        return (self.bets_kept + self.PRIOR_WEIGHT * self.PRIOR["model"]) / (self.bets + self.PRIOR_WEIGHT)

    def ahead_wait(self, decodes: np.ndarray | int, verify_s: np.ndarray | float) -> np.ndarray:
        """Expected seconds the loop waits after a verify of `verify_s` for a draft-ahead of `decodes` decodes
        (0 before the thread's lag was measured), elementwise: `_ahead_wait`'s arithmetic on arrays (the
        vectorised questions ask it for a whole table at once)."""
        step, lag = self.ahead_step_s or 0.0, self.ahead_lag_s or 0.0
        return np.maximum(0.0, lag + np.asarray(decodes) * step - np.asarray(verify_s))

    def _ahead_wait(self, decodes: int, verify_s: float) -> float:
        step, lag = self.ahead_step_s or 0.0, self.ahead_lag_s or 0.0
        return max(0.0, lag + decodes * step - verify_s)

    # The two questions below are asked every round with draft-ahead fitted to the verify, so they run on Python
    # floats (the same operations in the same order as the arrays they replaced: the same choices, bit for bit;
    # tests/test_ahead_cost.py checks them against the numpy formulas). On the 2-core CPU the numpy version cost
    # ~0.5 ms a round inside the loop (docs/performance.md, "T > 0 host share").

    def best_ahead(self, k: int, verify_s: float | None = None) -> int:
        """How many of the next round's k drafts to make beside a verify (`ahead_length = "fit"`): the j in
        0..k that minimises the wait for them plus the steps left to the round when its bet is kept,
        wait(1 + j) + P(kept) x (k - j) x step (the longer on a tie); k until the costs are measured."""
        if k <= 0 or self.ahead_step_s is None or self.ahead_lag_s is None or self.step_s is None:
            return k
        if verify_s is None:
            verify_s = self._verify_cost(k + 1)
        kept, step = self._table().survival["model"][k] * self.guess_rate, self.step_s
        best, choice = float("inf"), k
        for j in range(k, -1, -1):  # (the longer on a tie)
            cost = self._ahead_wait(1 + j, verify_s) + kept * (k - j) * step
            if cost < best:
                best, choice = cost, j
        return choice

    def best_continuation(self, ready: int, room: int, width: int = 0) -> int:
        """A kept bet holds `ready` drafts of a round of ready + room: how many more to draft now, on the path
        (0..room), for the fastest round: E(ready + n) / (verify + n steps); all of them until a step is
        measured."""
        if room <= 0:
            return 0
        if self.step_s is None or not self.verify_s:
            return room
        return self._kept_round(ready, room, width)[0]

    def kept_bet_speed(self, ready: int, room: int, width: int = 0) -> float | None:
        """Expected tokens per second of the round a kept bet holds: its `ready` drafts (made beside the last
        verify: no draft steps on the path) and the best continuation of up to `room` more; None until a verify
        (and, with room, a step) was measured. The chain weighs it against lookup's round (`DraftLength.prefer_bet`).
        """
        if not self.verify_s or (room > 0 and self.step_s is None):
            return None
        return self._kept_round(ready, max(room, 0), width)[1]

    def _kept_round(self, ready: int, room: int, width: int) -> tuple[int, float]:
        """(n, speed): the n in 0..room more drafts that make a kept bet's round fastest, E(ready + n) / (verify +
        n steps), the shorter on a tie; and that speed."""
        expected, step = self._table().cumulative["model"], self.step_s or 0.0
        best, choice = -float("inf"), 0
        for n in range(room + 1):  # (the shorter on a tie)
            speed = expected[ready + n] / (self._verify_cost(max(width, ready + n + 1)) + n * step)
            if speed > best:
                best, choice = speed, n
        return choice, best

    COLD_CALLS = 2  # after a width change llama.cpp runs the CUDA graph uncaptured for two calls (docs/gpu.md)

    def _observe_verify(self, width: int, seconds: float) -> None:
        """The verify's warm seconds per width; with CUDA graphs, the calls just after a width change are cold:
        their excess over the warm figure is what a change costs (`switch_s`), and they stay out of the figure."""
        if self.graphs:
            if width != self._width:
                # A width never verified has no warm figure to compare with: its cold calls seed the figure.
                self._measurable = width in self.verify_s and self.rounds > 1
                self._width, self._since_change, self._excess = width, 0, 0.0
            self._since_change += 1
            if self._since_change <= self.COLD_CALLS and self._measurable:
                self._excess += max(0.0, seconds - self.verify_s[width])
                if self._since_change == self.COLD_CALLS:
                    old = self.switch_s
                    self.switch_s = self._excess if old is None else (1 - self.EMA) * old + self.EMA * self._excess
                return
        old = self.verify_s.get(width)
        # A width not verified for DECAY rounds (re-measured now and then: `stalest_lookup`) takes the new figure
        # whole, as a step after a pause does: an old one-off slow figure would otherwise fade only 20% a visit.
        stale = self.rounds - self.verified.get(width, self.rounds) > self.DECAY
        self.verify_s[width] = seconds if old is None or stale else (1 - self.EMA) * old + self.EMA * seconds
        self.verified[width] = self.rounds

    def pad_rounds(self, wide: int) -> float:
        """How many rounds in a row with nothing drafted are worth verifying at the padded width `wide` rather
        than going narrow: a narrow spell costs two width changes (there and back), each padded round costs
        v(wide) - v(1). Padding for that many rounds, then going narrow, never pays more than twice the best
        choice in hindsight (the ski-rental rule), however long the drafts stay empty. A change's cost is measured
        (`switch_s`); before that its prior is one verify."""
        if not self.verify_s:
            return float("inf")
        one, padded = self._verify_cost(1), self._verify_cost(wide)
        switch = self.switch_s if self.switch_s is not None else one
        return 2 * switch / (padded - one) if padded > one else float("inf")

    def _table(self) -> _Tables:
        """The survivals and verify costs the last observation implies: computed once after it, then read by every
        question of the round (a round asks several; each recomputing them cost more than a small model's GPU
        step on the host)."""
        if self._tables is None:
            survival = {source: self._survival(source) for source in self.SOURCES}
            widths = range(self.k_max + 2)
            self._tables = _Tables(survival, {s: list(accumulate(v)) for s, v in survival.items()},
                                   self._verify_estimates(widths) if self.verify_s else [0.0 for _ in widths])
        return self._tables

    def _survival(self, source: str) -> list[float]:
        """S(0..k_max): the chance that positions 1..i of a `source` run are all accepted (S(0) = 1)."""
        # Each position's rate leans on the one before it (the source's prior for the first), so a position
        # never drafted borrows the deepest measured rate: acceptance is bursty, deep rates are rarely lower.
        tried, ok = self.tried[source], self.ok[source]
        rate, survival = self.PRIOR[source], [1.0]
        for i in range(1, self.k_max + 1):
            rate = (ok[i] + self.PRIOR_WEIGHT * rate) / (tried[i] + self.PRIOR_WEIGHT)
            survival.append(survival[-1] * rate)
        return survival

    def survival(self, source: str, n: int) -> np.ndarray:
        """S(0..n) of a `source` run (n <= k_max)."""
        return self._table().arrays()[0][source][: n + 1]

    def speeds(self, looked_up: int, room: int, width: int = 0) -> np.ndarray | None:
        """Expected tokens per second of a round of `looked_up` lookup tokens then n = 0..room model tokens,
        verified at `width` tokens (0: as wide as the drafts); None until the costs it needs were measured."""
        if not self.verify_s or (room and self.step_s is None):
            return None
        return self._speeds(np.array([looked_up]), room, width)[0, : room + 1]

    def _speeds(self, looked_up: np.ndarray, room: int, width: int, perfect: bool = False) -> np.ndarray:
        """`speeds` for each of several lookup lengths at once: a row per length, columns n = 0..room (`perfect`:
        as if every model token were accepted, and drafted on the path: see `could_pay`)."""
        survival, cumulative, _ = self._table().arrays()
        lookup, cum_lookup = survival["lookup"], cumulative["lookup"]
        cum_model = np.arange(self.k_max + 1) + 1.0 if perfect else cumulative["model"]
        j, n = looked_up[:, None], np.arange(room + 1)[None, :]
        # E = 1 + S_lookup(1..j) + S_lookup(j) * S_model(1..n)
        expected = cum_lookup[j] + lookup[j] * (cum_model[n] - 1.0)
        drafted = j + n
        # A padded round that drafts nothing is verified narrow once such rounds run on (`verify_width`).
        widths = np.where(drafted == 0, 1, np.maximum(width, drafted + 1))
        verify = self.verify_costs(widths)
        if perfect:
            return expected / (n * (self.step_s or 0.0) + verify)
        if self.ahead_step_s is None:  # no draft-ahead measured: its share of the steps, on average
            return expected / (n * (self.step_s or 0.0) * (1 - self.ahead) + verify)
        return expected / (verify + self._ahead_terms(j, n, verify))

    def _ahead_terms(self, looked_up: np.ndarray, n: np.ndarray, verify: np.ndarray) -> np.ndarray:
        """Seconds a round of `n` model tokens adds to its verify when the model drafts ahead: the bet on it made
        beside the last verify is kept with P = S(n) x guess rate (only where nothing was looked up: the model
        alone drafts ahead), so its round drafts n - j tokens on the path (j: those the bet drafted; `ahead_fit`
        fits j to the verify, else j = n) and n when it is thrown; plus the wait after the verify for the next
        bet's 1 + j decodes. n = 0 is a plain step: nothing beside it."""
        step = self.step_s or 0.0
        kept = np.where(looked_up == 0, self._table().arrays()[0]["model"][n] * self.guess_rate, 0.0)
        n, verify = np.broadcast_arrays(n, verify)
        ahead = n.copy()
        if self.ahead_fit:
            for (row, col), m in np.ndenumerate(n):
                ahead[row, col] = self.best_ahead(int(m), float(verify[row, col]))
        wait = np.where(n > 0, self.ahead_wait(1 + ahead, verify), 0.0)
        return step * (n - kept * ahead) + wait

    def verify_costs(self, widths: np.ndarray) -> np.ndarray:
        """Seconds of a verify at each width: measured, else from a line through the measured widths (floored at
        the narrowest one's), else (one width measured) from it by the prior slope."""
        widths = np.asarray(widths)
        table = self._table()
        if widths.size and widths.max() < len(table.verify):
            return table.arrays()[2][widths]
        return np.array(self._verify_estimates(widths.ravel().tolist())).reshape(widths.shape)

    def _verify_cost(self, width: int) -> float:
        """`verify_costs` of one width."""
        table = self._table().verify
        return table[width] if width < len(table) else self._verify_estimates([width])[0]

    def _verify_estimates(self, widths: Iterable[int]) -> list[float]:
        """Each width's measured seconds, else the estimate (`verify_costs`)."""
        narrowest = min(self.verify_s)
        at_narrowest, slope_prior = self.verify_s[narrowest], 1 + self.VERIFY_SLOPE * (narrowest - 1)
        line: tuple[float, float, float] | None = None
        if len(self.verify_s) > 1:  # the line through the tried widths (distinct: it has a slope)
            mean_w, mean_s, slope = _least_squares([(w, self.verify_s[w]) for w in sorted(self.verify_s)])
            line = (mean_s, slope or 0.0, mean_w)
        costs = []
        for width in widths:
            measured = self.verify_s.get(width)
            if measured is not None:
                costs.append(measured)
                continue
            prior = at_narrowest * (1 + self.VERIFY_SLOPE * (width - 1)) / slope_prior
            if line is None:
                costs.append(prior)
            else:
                mean_s, slope, mean_w = line
                on_line = mean_s + slope * (width - mean_w)
                costs.append(max(on_line, prior) if width < narrowest else max(on_line, at_narrowest))
        return costs

    def speed(self, looked_up: int, n: int, width: int = 0) -> float | None:
        """`speeds` at one n."""
        speeds = self.speeds(looked_up, n, width)
        return None if speeds is None else float(speeds[n])

    def best_extension(self, looked_up: int, room: int, width: int = 0) -> int | None:
        """How many model tokens (0..room) after `looked_up` lookup tokens make the fastest round (the shorter on a
        tie); None until the model's step and a verify were measured."""
        speeds = self.speeds(looked_up, room, width)
        return None if speeds is None else int(np.argmax(speeds))

    def could_pay(self, looked_up: int, room: int, width: int = 0) -> bool:
        """Whether some of the draft model's tokens after `looked_up` lookup tokens would make a faster round than
        none if every one of them were accepted, at the measured step and verify costs (True until measured).
        Drafted on the path, without draft-ahead's terms: those are measured only while the model drafts, so a
        wrong figure there must not judge it hopeless (never probed out of sync, never re-measured)."""
        if not self.verify_s or self.step_s is None or room <= 0:
            return True
        speeds = self._speeds(np.array([looked_up]), room, width, perfect=True)[0, : room + 1]
        return bool(speeds[1:].max() > speeds[0])

    def best_lookup(self, found: int, k: int, width: int = 0, chained: bool = False) -> int | None:
        """How many of prompt lookup's `found` tokens to propose (the longer on a tie: they cost no draft steps):
        the j in 0..found whose round is fastest — with the draft model's best extension after them when `chained`
        and its step is measured. None until a verify was measured."""
        if not self.verify_s:
            return None
        with_model = chained and self.step_s is not None
        speeds = self._speeds(np.arange(found + 1), k if with_model else 0, width)
        if with_model:  # j lookup tokens leave room for k - j of the model's
            speeds = np.where(np.add.outer(np.arange(found + 1), np.arange(k + 1)) <= k, speeds, -np.inf)
        best, choice = -1.0, 0
        for j, fastest in enumerate(speeds.max(axis=1).tolist()):
            if fastest >= best * (1 - 1e-9):
                best, choice = fastest, j
        return choice

    def unmeasured_lookup(self, best: int, found: int) -> int | None:
        """A lookup length in 1..found whose verify width (length + 1) was never measured, the nearest `best` (the
        shorter on a tie); None when each was. A verify's cost need not grow smoothly with its width: on the 2-core
        CPU the demo target verifies 6 tokens in 119-140 ms and 7 in 192-198, which the line through the tried
        widths cannot know (it put 6 at ~170 ms, so the chain proposed 6 tokens where 5 were 20% faster a token).
        So each width a lookup round can choose is measured once before the costs decide: at most k - 1 rounds a
        cost model, each still emitting its accepted tokens."""
        untried = [j for j in range(1, found + 1) if j + 1 not in self.verify_s]
        return min(untried, key=lambda j: (abs(j - best), j)) if untried else None

    def stalest_lookup(self, best: int, found: int) -> int:
        """Of the lookup lengths best + 1..found, the one whose verify width was measured longest ago (the longer
        on a tie): what a match cut short proposes now and then to measure a wider width again."""
        return min(range(best + 1, found + 1), key=lambda j: (self.verified.get(j + 1, -1), -j))

    def lookup_probe(self) -> bool:
        """Lookup's tokens are judged a loss this round: whether to propose them anyway (a probe, on the model's
        schedule: every `lookup_interval` such rounds, doubling while they stay a loss)."""
        self.lookup_idle += 1
        if self.lookup_idle >= self.lookup_interval:
            self.lookup_idle = 0
            self.lookup_interval = min(2 * self.lookup_interval, self.PROBE_MAX)
            return True
        return False

    def probe(self, room: int, lag: int = 1, in_sync_only: bool = False) -> int:
        """The model is judged a loss this round: 0 tokens, or PROBE when a probe is due (see the class). `lag`:
        the committed tokens the model's cells lack (1 when in sync: the next draft feeds cur), which a probe out of
        sync reads first (never, with `in_sync_only`)."""
        self.idle += 1
        if self.idle < self.interval:
            return 0
        if lag > 1:
            # Unmeasured, the first catch-up goes (it measures the price); then only while it stays affordable.
            if in_sync_only or not self._catch_up_affordable(lag):
                return 0
            self._probe_lag = lag
        self.idle = 0
        self.interval = min(2 * self.interval, self.PROBE_MAX)
        return min(room, self.PROBE)

    def _catch_up_affordable(self, lag: int) -> bool:
        """Whether reading `lag` tokens first (`catch_up_cost`) costs at most CATCH_UP_SHARE of the rounds the probe
        waited (each at least a one-token verify). On the 2-core CPU the draft model reads a token in about a fifth
        of a target step and a round commits several: a probe that caught up on 64 rounds cost ~1 s, several
        rounds' time; on a GPU it reads hundreds of tokens in a few ms and probes go on."""
        cost = self.catch_up_cost(lag)
        if cost is None or not self.verify_s:
            return True  # (unmeasured: the first such probe measures it)
        return cost <= self.CATCH_UP_SHARE * self.idle * self._table().verify[1]

    def catch_up_cost(self, lag: int) -> float | None:
        """Seconds a probe's first step adds to read `lag` tokens first, from the measured catch-ups; None: unmeasured.
        With CUDA graphs a part per call (a graph for the new width) and a part per token: a line through them
        (slope and intercept at least 0); measured at one lag only, the two cannot be told apart, so a longer lag is
        priced at that lag's cost until a probe measures one (priced per token, a 3.2-ms catch-up of 3 tokens, nearly
        all the graph's, kept the H200 chain from ever probing 30 tokens out of sync: docs/performance.md). On a CPU
        the tokens' part is all of it (8 ms a token on the 2-core CPU): per token."""
        if not self.catch_ups:
            return None
        mean_lag, mean_s, slope = _least_squares(self.catch_ups)
        if not self.graphs or slope is None:
            return mean_s * (min(1.0, lag / mean_lag) if self.graphs else lag / mean_lag)
        slope = max(0.0, slope)
        return max(0.0, mean_s - slope * mean_lag) + slope * lag

    def pays(self) -> None:
        """The model pays again: probing starts over from PROBE_FIRST when it next does not."""
        self.idle, self.interval, self.model_on = 0, self.PROBE_FIRST, True


class DraftLength:
    """Chooses k for the loop's next round, and how far the chained drafter's model extends a lookup match.

    Fixed (the preset's k every round), or `adaptive`: k in 0..k_max by the cost model, E[tokens | k] / cost(k),
    held for EPOCH rounds and changed only when the best beats the current length by MIN_GAIN. On CUDA every change
    of the verify width costs: llama.cpp rebuilds its compute graph and the CUDA graph runs uncaptured for two
    calls, then is captured again (docs/gpu.md: widths 7,7,5,5 cost 23.0 ms a call against 19.0 for 7 and 15.7 for
    5), so the width changes at most once an epoch (and for a probe). The first two epochs draft k_max and k_max / 2,
    since the verify line needs two widths. k = 0 is plain decoding; from there the cost model's probes (a round of
    `DraftCost.PROBE` tokens now and then) measure the draft model again.

    The chain's extension (`extension`) is decided per round by the same cost model, fixed or adaptive: the model
    adds the number of tokens that makes the round fastest, 0 when it is a net loss (then probed as above). Where
    lookup found nothing and the model alone was paying, it stays on until it is a loss by MIN_GAIN (its
    acceptance is an estimate from a few dozen rounds: a streak of rejections must not switch it off).

    The cost model is the slot's (`DraftCost`, kept across its generations with the same settings: what it measured
    stays valid); a fixed chooser is fresh per generation.
    """

    EPOCH = 16
    MIN_GAIN = 1.05
    # Rounds that draft a probe's length with the model before its measured cost decides the chain's: two steady
    # steps, so that one slow call (a CUDA graph captured) cannot judge it (the step is the least recent one).
    WARMUP = 2

    def __init__(self, cfg: Drafting, cost: DraftCost | None = None, padded: bool = False) -> None:
        self.k_max = cfg.n_draft
        # Adaptive sets the draft model's length. Lookup (alone or chained) keeps k: its tokens cost no draft steps,
        # and the chain's model share is decided each round by cost anyway (`extension`).
        self.adaptive = cfg.adaptive and self.k_max > 0 and cfg.drafter == "model"
        self.chained = cfg.drafter == "chain"
        self.cost = cost if cost is not None else DraftCost(self.k_max)
        self.padded = padded  # the verify is padded to k + 1 (CUDA graphs): the draft's width costs nothing extra
        self.ahead_fit = cfg.ahead_length == "fit"
        self.cost.ahead_fit = self.ahead_fit
        self.k = self.k_max
        self.rounds = 0
        self._decided = 0
        self._empty = 0  # rounds in a row with nothing drafted
        self._narrow = False  # verifying them at width 1 (else padded to k + 1)
        self._measuring = False  # this round's lookup length measures an unmeasured verify width

    def next(self) -> int:
        if not self.adaptive:
            return self.k
        if self.rounds and self.rounds % self.EPOCH == 0 and self._decided != self.rounds:
            self._decided = self.rounds
            self.k = self._choose()
        if self.k == 0:
            return self.cost.probe(self.k_max)
        return self.k

    def _choose(self) -> int:
        if self.rounds // self.EPOCH == 1 and self.k_max > 1:
            return self.k_max // 2  # a second width for the verify line
        best = self.cost.best_extension(0, self.k_max)
        if best is None:
            return self.k
        now, then = self.cost.speed(0, self.k), self.cost.speed(0, best)
        if best == self.k or now is None or then is None or then <= self.MIN_GAIN * now:
            return self.k
        if best and not self.k:
            self.cost.pays()
        return best

    def lookup_length(self, found: int, k: int) -> int:
        """How many of the `found` tokens prompt lookup matched to propose in a round of at most k: by cost, as
        `extension` (in the chain, the draft model may draft in their place); 0 where its measured acceptance
        makes them a loss at the measured verify costs, but all of them in a probe now and then."""
        if found == 0:
            return 0
        cost = self.cost
        best = cost.best_lookup(found, k, k + 1 if self.padded else 0, self.chained)
        if best is None or cost.seen["lookup"] < self.WARMUP:
            # Measure first: judged on its prior acceptance alone, a slow first verify of the draft model's
            # warm-up could back lookup off for a probe interval on text it copies (the CPU chain: 13 rounds).
            return found
        if best:
            cost.lookup_idle, cost.lookup_interval, cost.lookup_off = 0, cost.PROBE_FIRST, False
            # Where the width is the drafts' own (no padding), an unmeasured one is tried once first: the chain's
            # model then adds nothing this round (`extension`), so the verify measures that width.
            untried = None if self.padded else cost.unmeasured_lookup(best, found)
            if untried is not None:
                self._measuring = True
                return untried
            if best < found:
                # Cut short by the verify's cost at the longer widths: measured once, maybe in a slow moment, a
                # width not verified again is never measured again (the 2-core CPU: v(7) stuck at 327 ms, 2.3x
                # v(4), so lookup proposed 3 of 6 tokens right 99% of the time; under load, v(6) measured once
                # at 1.7x v(4) held lookup at 3). Every EPOCH such rounds in a row, a longer length, the one whose
                # width was measured longest ago (padded, where every width costs the same: all of them).
                cost.lookup_short += 1
                if cost.lookup_short >= self.EPOCH:
                    cost.lookup_short = 0
                    best = found if self.padded else cost.stalest_lookup(best, found)
                    self._measuring = not self.padded
            else:
                cost.lookup_short = 0
            return best
        # A loss at the full length is one at any (`best_lookup` takes the best j <= found, and a match is k long):
        # backed off until a probe or a new judgement. A shorter round's (k cut by max_tokens) says less.
        cost.lookup_off = cost.lookup_off or k >= self.k_max
        return found if cost.lookup_probe() else 0

    def lookup_wanted(self) -> bool:
        """Whether prompt lookup should search this round. Not while its tokens are judged a loss (`lookup_length`
        cut a match to nothing): each such round counts towards its probe as a cut match does. But it searches
        when a probe is due (the next match is proposed whole), right after one and every EPOCH rounds, for
        `lookup_length` to judge again (by the probe's verdict; the verify costs may have moved)."""
        cost = self.cost
        if not cost.lookup_off or cost.lookup_idle + 1 >= cost.lookup_interval:
            return True
        judge = cost.lookup_idle % self.EPOCH == 0
        cost.lookup_idle += 1
        return judge

    def extension(self, looked_up: int, k: int, lag: int = 1) -> int:
        """How many draft-model tokens should follow `looked_up` lookup tokens in a round of at most k drafts.
        `lag`: how many committed tokens the draft model's cells lack (1: in sync, a probe costs no catching up;
        more: a probe out of sync waits while catching up would cost too much)."""
        room = k - looked_up
        if room <= 0 or self._measuring:
            return 0
        width = k + 1 if self.padded else 0
        speeds = self.cost.speeds(looked_up, room, width)
        if speeds is None:
            return min(room, self.cost.PROBE)  # measure first, as cheaply as a probe
        n = int(np.argmax(speeds))
        # Judged where the model's tokens pay most (no lookup tokens before them: all of k, the narrowest verify);
        # asked only where the answer matters (a round's host work is on the path).
        hopeless = (not n or self.cost.model_rounds < self.WARMUP) and not self.cost.could_pay(0, k, width)
        if self.cost.model_rounds < self.WARMUP:
            return min(room, self.cost.PROBE) if hopeless else room
        if not n and not looked_up and not hopeless and self.cost.model_on:
            # The model alone was paying: it stays on until it is a loss by MIN_GAIN. Its acceptance is measured
            # over a few dozen rounds, and a streak of early rejections (the H200 replay at 85%: S(6) estimated
            # 0.12 against 0.38) would otherwise switch off a model worth 1.4x plain until the next probe.
            best = 1 + int(np.argmax(speeds[1:]))
            n = best if self.MIN_GAIN * speeds[best] >= speeds[0] else 0
        if n:
            self.cost.pays()
            return n
        if not looked_up:
            self.cost.model_on = False
        if hopeless:
            # A loss even if every token were accepted (the 2-core CPU: a draft step ~ a one-token verify): no
            # acceptance a probe could measure turns it on, only a change of costs, so it is probed at the longest
            # interval, and only where the model's cells are current (catching up would be pure loss).
            self.cost.interval = self.cost.PROBE_MAX
        probe = self.cost.probe(room, lag, in_sync_only=hopeless)
        # A probe of a model that could pay drafts all the room: two tokens measure two positions, and the deeper
        # ones, borrowing the last measured rate, would be judged on one rejection.
        return room if probe and not hopeless else probe

    def verify_width(self, wide: int, drafted: int) -> int:
        """The verify batch's width on a GPU (CUDA graphs), given `wide` (k + 1: where the drafts are padded to)
        and this round's `drafted` tokens: two widths only, with hysteresis. Drafts go wide; a round with nothing
        drafted (lookup found no match, the chain's model sat out) stays padded for `DraftCost.pad_rounds` such
        rounds in a row, then goes narrow (1) until something is drafted again. The draft model with a fixed k
        always drafts, so it always verifies wide, as before."""
        if drafted or wide <= 1:
            self._empty, self._narrow = 0, False
            return max(wide, drafted + 1)
        self._empty += 1
        if not self._narrow and self._empty > self.cost.pad_rounds(wide):
            self._narrow = True
        return 1 if self._narrow else wide

    def prefer_bet(self, looked_up: int, k: int, ready: int, room: int) -> bool:
        """The chain holds a kept bet (`ready` drafts made beside the last verify, `room` more it may draft on the
        path) and lookup found `looked_up` tokens in a round of at most k: whether the bet's round is expected to
        be at least as fast (tokens per second) as lookup's tokens with the model's best extension on the path.
        The bet unless lookup is expected to pay more (the bet cost no draft steps; unmeasured: the bet)."""
        width = k + 1 if self.padded else 0
        bet = self.cost.kept_bet_speed(ready, room, width)
        lookup = self.cost.speeds(looked_up, k - looked_up, width)
        return bet is None or lookup is None or float(lookup.max()) <= bet

    def ahead_length(self, k: int) -> int:
        """How many of the next round's k drafts to make beside this verify: all of them, or with `ahead_length =
        "fit"` what the cost model says fits (`DraftCost.best_ahead`; the drafter also stops when the verify
        ends)."""
        return self.cost.best_ahead(k) if self.ahead_fit else k

    def continuation(self, ready: int, k: int) -> int:
        """A kept bet holds `ready` of the round's k drafts: how many more the round drafts on the path."""
        return self.cost.best_continuation(ready, k - ready, k + 1 if self.padded else 0)

    def observe_ahead(self, seconds: float, decodes: int, could_keep: bool, kept: bool) -> None:
        self.cost.observe_ahead(seconds, decodes, could_keep, kept)

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, width: int,
                looked_up: int = 0, first_s: float | None = None, ahead: int = 0,
                wait_s: float | None = None, least_s: float | None = None) -> None:
        self.rounds += 1
        self._measuring = False
        self.cost.observe(drafted, accepted, draft_s, verify_s, width, looked_up, first_s, ahead, wait_s, least_s)


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
