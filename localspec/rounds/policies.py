"""How long the drafts are: what one stream's rounds measured (shared by whoever drafts), the loop's choice of k
from a drafter's prices, and the batch-size load policy.

A drafter prices its own proposals (`localspec/drafters/`: its `CostRule`, kept with the stream's `DraftCost`);
what every rule needs is measured here once: the verify's seconds per width (a line through the tried widths), the
seconds of a draft step, and each source's per-position acceptance. The loop asks `DraftLength` once per round
(`Schedule.plan`, the one place k is decided) and tells it what the round measured. No drafter is named here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol, TypeVar

import numpy as np

from localspec.config import Drafting


@dataclass(slots=True)
class _Tables:
    """What one observation of `DraftCost` implies, per source and per verify width: Python floats, read one by one
    by the questions every round asks (the draft model's `best_draft_ahead`, `best_continuation`: inside the loop,
    between decodes, each numpy call cost more than the arithmetic it did), and as arrays, made when first asked, by
    the vectorised ones (`DraftCost.speeds`)."""

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


_NONE = np.ones(1)  # the tables of a source a round does not draft from: S(0) = 1, 1 + nothing = 1


def _least_squares(points: Iterable[tuple[float, float]]) -> tuple[float, float, float | None]:
    """(mean x, mean y, the least-squares slope; None where the xs do not vary), in closed form: np.polyfit costs
    ~50 us a call, and the cost model asks inside the loop."""
    points = list(points)
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return mean_x, mean_y, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


@dataclass(frozen=True, slots=True)
class Observation:
    """One round as it was measured (`DraftCost.observe`): its verdict and costs, handed to each drafter's rule after
    the shared facts took it. `drafted` tokens, the first `lead` from the lead source and the rest stepped (which
    took `draft_s`, the first step `first_s`: None if unknown, the least of the later steps `least_s`; `drafted_ahead`
    of them were drafted beside the last verify, off the path), of which `accepted` were; the verify of `width` tokens
    took `verify_s`, then the loop waited `wait_s` for the work beside it (None: none ran)."""

    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    width: int
    lead: int = 0
    first_s: float | None = None
    drafted_ahead: int = 0
    wait_s: float | None = None
    least_s: float | None = None


Rule = TypeVar("Rule", bound="CostRule")


class CostRule:
    """A drafter's own cost rule: how it prices its proposals and the state that takes, kept with one stream's
    `DraftCost` (`of`: made on first use, kept as long as the cost model). Subclasses live with their drafters."""

    def __init__(self, cost: DraftCost) -> None:
        self.cost = cost

    @classmethod
    def of(cls: type[Rule], cost: DraftCost) -> Rule:
        """This rule of the stream whose measured facts `cost` holds."""
        return cost.rule(cls)

    def observed(self, round_: Observation) -> None:
        """A round, after the shared facts took it."""

    def begin_generation(self) -> None:
        """A new generation (request) starts on the stream (`DraftCost.begin_generation`): a rule whose acceptance is
        the text's forgets it here, with whatever it judged from it; one whose acceptance is its model's keeps it."""


class Stepped(Protocol):
    """A rule whose tokens cost draft steps (`DraftCost.speeds` asks it what n of them add to a round)."""

    source: str

    def seconds(self, lead: np.ndarray, n: np.ndarray, verify: np.ndarray, perfect: bool) -> np.ndarray:
        """Seconds that n of its tokens after `lead` lead tokens add to a round verified in `verify` seconds
        (elementwise; `perfect`: drafted on the path, every one accepted)."""
        ...


class Pricing(Protocol):
    """A drafter's prices of its own drafts alone, by which `DraftLength` chooses k with `adaptive`."""

    def best_length(self, room: int) -> int | None:
        """The draft length in 0..room of the fastest round (the shorter on a tie); None until measured."""
        ...

    def length_speed(self, n: int) -> float | None:
        """Expected tokens per second of a round of n drafts; None until measured."""
        ...

    def pays(self) -> None:
        """Drafting pays again (after k = 0)."""
        ...

    def probe(self, room: int) -> int:
        """k = 0 was chosen: 0, or the length of a probe when one is due (drafting is judged again by it)."""
        ...


class DraftCost:
    """What one stream's rounds measured, shared by whoever drafts, and each drafter's rule kept beside it.

    Measured each round (`observe`): the verify's seconds at its width (an untried width from a line through the
    tried ones; with one tried width, a prior slope; with CUDA graphs, what a width change costs), the seconds of a
    draft step (steady steps only, and what a first step's catching up cost), and per source (the drafters' rules
    add theirs: `add_source`) each position's conditional acceptance, P(position i accepted | positions before it
    were). A round drafts a source's `lead` tokens first (no draft steps: prompt lookup's), then the stepped
    source's, one draft step each (a draft model's); it yields E = 1 + sum of the survivals S(i) = P(positions 1..i
    all accepted) tokens and costs the verify of its width (the padded width on a GPU) plus its steps (`speeds`):
    E / cost is a round's price in tokens per second, and a round that drafts nothing is a plain step, whose cost
    (a one-token verify) is what one token is worth. Older rounds count less (acceptance drifts with the text): a
    source's counts halve every DECAY rounds of the stream, so one not drafted for long drifts back to its prior
    rate, or (`own_epochs`) every DECAY rounds that drafted it, so one sitting out keeps its judgement until a probe.

    A drafter's tokens judged a loss are not drafted, so they could never be judged again: its rule probes them
    every `interval` such rounds, the interval starting at PROBE_FIRST (one adaptive epoch) and doubling while the
    loss is confirmed, up to PROBE_MAX (probing then costs a couple of draft steps per 256 rounds, under 1%).

    Kept with a slot across its generations (`kept_length`): the prices are the machine's and stay; so does a
    model's acceptance. A text's acceptance (prompt lookup's, suffix lookup's) starts again from its prior with each
    generation (`begin_generation`).
    """

    PRIOR_WEIGHT = 2.0  # a source's prior acceptance counts as this many rounds
    VERIFY_SLOPE = 0.25  # one tried width: an extra token costs this share of a 1-token verify (GPU ~0.17, CPU ~0.3)
    EMA = 0.2
    DECAY = 16
    PROBE_FIRST, PROBE_MAX = 16, 256
    PLAIN_GENERATIONS = 16  # hopeless drafting: generations decoded plainly for each one its rule judges (and probes)
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
        # Per source (`add_source`), index i: rounds that verified position i (Python floats: counted every round,
        # read by `_survival`)
        self.prior: dict[str, float] = {}  # a position's acceptance before anything is measured there
        self.tried: dict[str, list[float]] = {}
        self.ok: dict[str, list[float]] = {}
        self.seen: dict[str, int] = {}  # rounds that verified a token of the source
        self._aged: dict[str, int] = {}  # per source: the DECAY epoch of rounds its counts were aged to
        self._own_epochs: set[str] = set()  # sources whose counts age with the rounds that drafted them
        self.lead_source: str | None = None  # whose tokens come first in a round, at no draft step
        self.step_source: str | None = None  # whose tokens follow, one draft step each
        self.step_s: float | None = None  # seconds per draft step: the least of the recent steady ones
        self._steps: deque[float] = deque(maxlen=self.STEPS)
        self.step_rounds = 0  # rounds that drafted with draft steps (the step cost is known after one)
        self.last_step_round = 0
        self.verify_s: dict[int, float] = {}
        self.verified: dict[int, int] = {}  # per width: the round its verify was last measured
        # Catching up, measured on probes out of sync: (tokens the stepped drafter had sat out, the excess of the
        # probe's first step over a steady step), the recent ones (`catch_up_cost`); `probe_lag`: the lag of the
        # probe a rule issued this round.
        self.catch_ups: deque[tuple[int, float]] = deque(maxlen=self.STEPS)
        self.probe_lag = 0
        self._tables: _Tables | None = None  # what the last observation implies, computed once when first asked
        self._rules: dict[type, CostRule] = {}
        # Why drafting stands aside now, in one line from these prices (`[draft] stand_aside`: the drafter's rule
        # sets it), None while it drafts; kept with the facts across a slot's generations, as the verdict is.
        self.aside: str | None = None
        # ... and whether it would lose at any acceptance (a draft step about a one-token verify): then whole
        # generations decode plainly (`Stream`), all but every PLAIN_GENERATIONS-th, whose rounds the rule judges
        self.hopeless = False
        self.plain_generations = 0
        # The chain's draft model alone judged so (`ChainCost.extension`): its generations read none of the prompt
        # into the draft (`ChainDrafter.begin`: it could draft only after catching up, which a hopeless model never
        # does), all but every PLAIN_GENERATIONS-th, which reads it and probes in sync; the chain's lead drafts on.
        self.model_hopeless = False
        self.model_hopeless_steps = 0  # `step_rounds` when so judged: the verdict stands until a step is measured
        self.model_generations = 0

    def inherit(self, others: Iterable[DraftCost]) -> None:
        """A new slot's cost model starts from the other slots' facts of the models and the machine, not of a
        conversation. Their verdict that drafting is hopeless (a draft step about a one-token verify): its first
        generation then decodes plainly instead of judging again, which would pay the draft's read of the prompt, its
        probes and host-sampled rounds (0.77x plain at 4 clients on the CPU demo pair, every slot judging once). And
        the measured prices of the one that measured most (`_take_prices`): the draft step, the catch-ups, the verify
        per width and a width change, so that its rules decide from the first round (the chain's verdict on its draft
        model with no probe, prompt lookup with no round measuring a width). Acceptance (per source) stays the
        conversation's: it starts from the priors (as a text's acceptance does in a kept cost model with each
        generation, `begin_generation`). Its own judged generations (every PLAIN_GENERATIONS-th) measure as before;
        nothing measured by any other slot, it starts as a slot alone does."""
        others = list(others)
        for other in others:
            if other.hopeless or other.model_hopeless:
                self.hopeless, self.model_hopeless, self.aside = other.hopeless, other.model_hopeless, other.aside
                self.model_hopeless_steps = other.model_hopeless_steps
                break
        measured = [other for other in others if other.verify_s or other.step_s is not None]
        if measured:
            self._take_prices(max(measured, key=lambda other: (other.step_rounds, other.rounds)))

    def _take_prices(self, other: DraftCost) -> None:
        """Copies (no list or deque shared) of `other`'s measured prices, their ages kept.

        The counters: `rounds` starts at 0 here (the stream's own rounds: acceptance's DECAY epochs age with them,
        and no acceptance is taken). A round mark of `other`'s (`last_step_round`, `verified` per width) is moved by
        -other.rounds, so that it lies as many rounds before this stream's first round as it lay before `other`'s
        last (0 or below): a figure `other` measured just now is fresh here (averaged into, not replaced, by this
        stream's next measurement), one it measured more than DECAY rounds ago is stale here too (replaced whole, as
        a figure after a pause is), and lookup's stalest width stays the stalest. `step_rounds` is taken as it is:
        the draft step was measured in that many rounds, warm-up included, so the rules that wait for WARMUP steady
        steps before judging (`ChainCost.extension`, `ModelCost.stand_aside`) judge from the first round rather than
        probe to measure it again. With CUDA graphs, `switch_s` (a width change's excess) is taken; this stream's
        last width (`_width`) stays 0, none verified yet, and its first width with a figure here (taken) is a
        measured change (`_observe_verify`): its first verify follows its prompt's decode, a change of shape, and
        its cold calls stay out of the warm figure."""
        shift = -other.rounds
        self.step_s, self._steps = other.step_s, deque(other._steps, maxlen=self.STEPS)
        self.step_rounds, self.last_step_round = other.step_rounds, other.last_step_round + shift
        self.catch_ups = deque(other.catch_ups, maxlen=self.STEPS)
        self.verify_s = dict(other.verify_s)
        self.verified = {width: at + shift for width, at in other.verified.items()}
        self.switch_s = other.switch_s
        self._tables = None

    def begin_generation(self) -> None:
        """A new generation (request) starts on this stream (`kept_length`, the one place): each rule forgets what
        it measured of the last one's text (`CostRule.begin_generation`). Prompt lookup's and suffix lookup's
        acceptance is the text's (whether this reply copies its prompt, or repeats an earlier request), so theirs
        starts again from its prior, with their judgement (backed off, the probe interval): one reply whose matches
        were wrong held lookup off through the next, which copied its prompt (the CPU demo pair's code edit at T =
        0.7: 5 tokens drafted in 395 rounds, where k = 6 kept 310; docs/lab/2026-12-07-cpu-seeds-probes.md). A
        draft model's (or a head's) acceptance is how well it predicts its target, much the same from one reply to
        the next, and stays. So do the prices (the verify per width and its marks, the draft step, catch-ups, a width
        change) and the verdict that drafting is hopeless (`hopeless`, `model_hopeless` and their generation
        counters): facts of the models and the machine."""
        for rule in self._rules.values():
            rule.begin_generation()

    def restart_source(self, name: str) -> None:
        """Forget a source's measured acceptance: each position's rate is its prior again and no round has verified
        its tokens (`seen`), as in a new cost model, so a rule that measures a source before judging it does so
        again (`LookupCost.length`: its first WARMUP rounds proposed whole). A source's counts start here too
        (`add_source`)."""
        if name not in self.prior:
            return
        self.tried[name] = [0.0] * (self.k_max + 1)
        self.ok[name] = [0.0] * (self.k_max + 1)
        self.seen[name] = 0
        self._aged[name] = 0
        self._tables = None

    def rule(self, kind: type[Rule]) -> Rule:
        """The drafter rule `kind` kept with these facts (made on first use)."""
        found = self._rules.get(kind)
        if found is None:
            found = self._rules[kind] = kind(self)
        return found  # type: ignore[return-value]

    def add_source(self, name: str, prior: float, *, lead: bool = False, own_epochs: bool = False) -> None:
        """Count a source's per-position acceptance from here on: the lead source's tokens come first in a round
        (`observe`'s `lead`), the stepped one's after them. `own_epochs`: its counts age with the rounds that
        drafted it rather than with the stream's."""
        if name in self.prior:
            return
        self.prior[name] = prior
        self.restart_source(name)
        if own_epochs:
            self._own_epochs.add(name)
        if lead:
            self.lead_source = name
        else:
            self.step_source = name
        self._tables = None

    def changed(self) -> None:
        """A rule's figures moved: the tables are computed afresh when next asked."""
        self._tables = None

    def observe(self, round_: Observation) -> None:
        """One round (`Observation`)."""
        drafted, accepted, draft_s, lead = round_.drafted, round_.accepted, round_.draft_s, round_.lead
        first_s, ahead, least_s = round_.first_s, round_.drafted_ahead, round_.least_s
        self.rounds += 1
        self._tables = None
        verified = min(accepted + 1, drafted)  # positions 1..accepted passed; the next one (if drafted) failed
        for source, (tried, ok) in ((self.lead_source, (min(verified, lead), min(accepted, lead))),
                                    (self.step_source, (max(0, verified - lead), max(0, accepted - lead)))):
            if not tried or source is None:
                continue
            self.seen[source] += 1
            # A stepped source's counts age with the stream's rounds, so a probe after a pause is not weighed
            # against rejections long past; prompt lookup's with its own (aged towards its 0.9 prior, every probe
            # re-enabled a lookup right 1 time in 5). docs/lab, the seventh run.
            epoch = self.seen[source] // self.DECAY if source in self._own_epochs else self.rounds // self.DECAY
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
        on_path = drafted - lead - ahead  # the stepped tokens drafted in this round, not beside the last verify
        if on_path > 0 and draft_s > 0.0:  # (0 s: drafted ahead, beside the last verify: no step measured)
            # A step after the first: the first also reads what the drafter had not seen (a catch-up after sitting
            # out, lookup's drafts) and may capture a CUDA graph; a one-step round stands in until one is measured.
            # The least of them: on CUDA the two after the catch-up's width change run uncaptured, and a probe's
            # average step, about twice a steady one, judged the model a loss
            # (docs/lab/2026-12-02-chain-code-edit-replay.md).
            if least_s is not None:
                steady: float | None = least_s
            elif first_s is None:
                steady = draft_s / on_path
            else:
                steady = (draft_s - first_s) / (on_path - 1) if on_path > 1 else None
            # A step measured after a long pause (a probe) replaces the old figures: the machine may have changed.
            if self.rounds - self.last_step_round > self.DECAY:
                self._steps.clear()
            if steady is not None or not self._steps:
                self._steps.append(draft_s / on_path if steady is None else steady)
            self.step_s = min(self._steps)
            self.step_rounds += 1
            self.last_step_round = self.rounds
            if self.probe_lag and first_s is not None:
                self.catch_ups.append((self.probe_lag, max(0.0, first_s - self.step_s)))
        self.probe_lag = 0
        self._observe_verify(round_.width, round_.verify_s)
        if self._rules:
            for rule in self._rules.values():
                rule.observed(round_)

    COLD_CALLS = 2  # after a width change llama.cpp runs the CUDA graph uncaptured for two calls (docs/gpu.md)

    def _observe_verify(self, width: int, seconds: float) -> None:
        """The verify's warm seconds per width; with CUDA graphs, the calls just after a width change are cold:
        their excess over the warm figure is what a change costs (`switch_s`), and they stay out of the figure."""
        if self.graphs:
            if width != self._width:
                # A width never verified has no warm figure to compare with: its cold calls seed the figure. (A
                # stream's first verify has one only where it was taken from another slot, `_take_prices`.)
                self._measurable = width in self.verify_s
                self._width, self._since_change, self._excess = width, 0, 0.0
            self._since_change += 1
            if self._since_change <= self.COLD_CALLS and self._measurable:
                self._excess += max(0.0, seconds - self.verify_s[width])
                if self._since_change == self.COLD_CALLS:
                    old = self.switch_s
                    self.switch_s = self._excess if old is None else (1 - self.EMA) * old + self.EMA * self._excess
                return
        old = self.verify_s.get(width)
        # A width not verified for DECAY rounds (re-measured now and then: prompt lookup's stalest width) takes the
        # new figure whole, as a step after a pause does: an old one-off slow figure would otherwise fade only 20%
        # a visit.
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
        one, padded = self.verify_cost(1), self.verify_cost(wide)
        switch = self.switch_s if self.switch_s is not None else one
        return 2 * switch / (padded - one) if padded > one else float("inf")

    def tables(self) -> _Tables:
        """The survivals and verify costs the last observation implies: computed once after it, then read by every
        question of the round (a round asks several; each recomputing them cost more than a small model's GPU
        step on the host)."""
        if self._tables is None:
            survival = {source: self._survival(source) for source in self.prior}
            widths = range(self.k_max + 2)
            self._tables = _Tables(survival, {s: list(accumulate(v)) for s, v in survival.items()},
                                   self._verify_estimates(widths) if self.verify_s else [0.0 for _ in widths])
        return self._tables

    def _survival(self, source: str) -> list[float]:
        """S(0..k_max): the chance that positions 1..i of a `source` run are all accepted (S(0) = 1)."""
        # Each position's rate leans on the one before it (the source's prior for the first), so a position
        # never drafted borrows the deepest measured rate: acceptance is bursty, deep rates are rarely lower.
        tried, ok = self.tried[source], self.ok[source]
        rate, survival = self.prior[source], [1.0]
        for i in range(1, self.k_max + 1):
            rate = (ok[i] + self.PRIOR_WEIGHT * rate) / (tried[i] + self.PRIOR_WEIGHT)
            survival.append(survival[-1] * rate)
        return survival

    def survival(self, source: str, n: int) -> np.ndarray:
        """S(0..n) of a `source` run (n <= k_max)."""
        return self.tables().arrays()[0][source][: n + 1]

    def speeds(self, lead: np.ndarray, room: int, width: int, stepped: Stepped | None = None,
               perfect: bool = False) -> np.ndarray:
        """Expected tokens per second of rounds of j lead tokens (a row per j of `lead`) then n = 0..room of
        `stepped`'s tokens (the columns; none without it), verified at `width` tokens (0: as wide as the drafts):
        E = 1 + S_lead(1..j) + S_lead(j) x S_stepped(1..n) over the verify plus what the steps add (`perfect`: as
        if every stepped token were accepted, and drafted on the path)."""
        survival, cumulative, _ = self.tables().arrays()
        lead_survival, lead_cumulative = ((survival[self.lead_source], cumulative[self.lead_source])
                                          if self.lead_source is not None else (_NONE, _NONE))
        if stepped is None:
            stepped_cumulative = _NONE
        else:
            stepped_cumulative = np.arange(self.k_max + 1) + 1.0 if perfect else cumulative[stepped.source]
        j, n = lead[:, None], np.arange(room + 1)[None, :]
        expected = lead_cumulative[j] + lead_survival[j] * (stepped_cumulative[n] - 1.0)
        drafted = j + n
        # A padded round that drafts nothing is verified narrow once such rounds run on (`verify_width`).
        widths = np.where(drafted == 0, 1, np.maximum(width, drafted + 1))
        verify = self.verify_costs(widths)
        if stepped is None:
            return expected / verify
        return expected / (verify + stepped.seconds(j, n, verify, perfect))

    def verify_costs(self, widths: np.ndarray) -> np.ndarray:
        """Seconds of a verify at each width: measured, else from a line through the measured widths (floored at
        the narrowest one's), else (one width measured) from it by the prior slope."""
        widths = np.asarray(widths)
        table = self.tables()
        if widths.size and widths.max() < len(table.verify):
            return table.arrays()[2][widths]
        return np.array(self._verify_estimates(widths.ravel().tolist())).reshape(widths.shape)

    def plain_unpriced(self, padded: bool) -> bool:
        """Whether a round should be plain to price plain decoding: without a padded verify (a CPU: no width to keep
        warm) and no one-token verify measured yet, plain decoding's price is the prior slope's guess from the wider
        verifies, which makes drafting look paying; a plain round costs nothing over plain decoding and measures it."""
        return not padded and 1 not in self.verify_s

    def verify_cost(self, width: int) -> float:
        """`verify_costs` of one width."""
        table = self.tables().verify
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

    def catch_up_cost(self, lag: int) -> float | None:
        """Seconds a probe's first step adds to read `lag` tokens first, from the measured catch-ups; None:
        unmeasured. With CUDA graphs a part per call (a graph for the new width) and a part per token: a line through
        them (slope and intercept at least 0); measured at one lag only, the two cannot be told apart, so a longer lag
        is priced at that lag's cost until a probe measures one (priced per token, a short catch-up that was nearly all
        the graph's kept the chain from ever probing far out of sync: docs/lab/2026-12-02-chain-code-edit-replay.md).
        On a CPU the tokens' part is all of it (docs/lab/2026-12-01-drafters.md): per token."""
        if not self.catch_ups:
            return None
        mean_lag, mean_s, slope = _least_squares(self.catch_ups)
        if not self.graphs or slope is None:
            return mean_s * (min(1.0, lag / mean_lag) if self.graphs else lag / mean_lag)
        slope = max(0.0, slope)
        return max(0.0, mean_s - slope * mean_lag) + slope * lag


class DraftLength:
    """Chooses k for the loop's next round; the stream's drafter decides within it by its own prices.

    Fixed (the preset's k every round), or `adaptive` where the drafter prices its drafts alone (`Pricing`): k in
    0..k_max by E[tokens | k] / cost(k), held for EPOCH rounds and changed only when the best beats the current
    length by MIN_GAIN. On CUDA every change of the verify width costs: llama.cpp rebuilds its compute graph and the
    CUDA graph runs uncaptured for two calls, then is captured again (docs/gpu.md: widths 7,7,5,5 cost 23.0 ms a
    call against 19.0 for 7 and 15.7 for 5), so the width changes at most once an epoch (and for a probe). The
    first two epochs draft k_max and k_max / 2, since the verify line needs two widths. k = 0 is plain decoding;
    from there the drafter's probes measure its drafts again.

    The cost model is the slot's (`DraftCost`, kept across its generations with the same settings: what it measured
    stays valid, `kept_length`); a fixed chooser is fresh per generation.
    """

    EPOCH = 16
    MIN_GAIN = 1.05
    # Rounds that draft a probe's length with a stepped drafter before its measured cost decides: two steady
    # steps, so that one slow call (a CUDA graph captured) cannot judge it (the step is the least recent one).
    WARMUP = 2

    def __init__(self, cfg: Drafting, cost: DraftCost | None = None, padded: bool = False,
                 pricing: Pricing | None = None) -> None:
        self.k_max = cfg.n_draft
        # Adaptive sets the length by the drafter's prices of its drafts alone; a drafter without them keeps k
        # (prompt lookup's tokens cost no draft steps, and a chain decides its parts' shares each round by cost).
        self.pricing = pricing
        self.adaptive = cfg.adaptive and self.k_max > 0 and pricing is not None
        self.cost = cost if cost is not None else DraftCost(self.k_max)
        self.padded = padded  # the verify is padded to k + 1 (CUDA graphs): the draft's width costs nothing extra
        self.k = self.k_max
        self.rounds = 0
        self._decided = 0
        self._empty = 0  # rounds in a row with nothing drafted
        self._narrow = False  # verifying them at width 1 (else padded to k + 1)

    def rule(self, kind: type[Rule]) -> Rule:
        """The stream's drafter rule `kind` (`DraftCost.rule`): what a drafter asks its own prices through."""
        return self.cost.rule(kind)

    @property
    def aside(self) -> str | None:
        """Why drafting stands aside now (`[draft] stand_aside`, the drafter's rule says: `DraftCost.aside`)."""
        return self.cost.aside

    def next(self) -> int:
        if not self.adaptive:
            return self.k
        assert self.pricing is not None
        if self.rounds and self.rounds % self.EPOCH == 0 and self._decided != self.rounds:
            self._decided = self.rounds
            self.k = self._choose(self.pricing)
        if self.k == 0:
            return self.pricing.probe(self.k_max)
        return self.k

    def _choose(self, pricing: Pricing) -> int:
        if self.rounds // self.EPOCH == 1 and self.k_max > 1:
            return self.k_max // 2  # a second width for the verify line
        best = pricing.best_length(self.k_max)
        if best is None:
            return self.k
        now, then = pricing.length_speed(self.k), pricing.length_speed(best)
        if best == self.k or now is None or then is None or then <= self.MIN_GAIN * now:
            return self.k
        if best and not self.k:
            pricing.pays()
        return best

    def verify_width(self, wide: int, drafted: int) -> int:
        """The verify batch's width on a GPU (CUDA graphs), given `wide` (k + 1: where the drafts are padded to)
        and this round's `drafted` tokens: two widths only, with hysteresis. Drafts go wide; a round with nothing
        drafted (lookup found no match, the chain's model sat out) stays padded for `DraftCost.pad_rounds` such
        rounds in a row, then goes narrow (1) until something is drafted again. A drafter that always drafts
        always verifies wide."""
        if drafted or wide <= 1:
            self._empty, self._narrow = 0, False
            return max(wide, drafted + 1)
        self._empty += 1
        if not self._narrow and self._empty > self.cost.pad_rounds(wide):
            self._narrow = True
        return 1 if self._narrow else wide

    def observe(self, round_: Observation) -> None:
        self.rounds += 1
        self.cost.observe(round_)


KEPT_POLICIES = 8  # per slot: one per drafting settings recently used there


def kept_length(kept: dict[tuple, DraftLength], drafting: Drafting, greedy: bool, padded: bool,
                pricing: Callable[[DraftCost], Pricing | None],
                siblings: Iterable[dict[tuple, DraftLength]] = ()) -> DraftLength:
    """A generation's draft-length policy in a slot whose recent ones are `kept` (by drafting settings; the most
    recent last). A fixed length's chooser is fresh each generation. An adaptive one is kept across the slot's
    generations with the same drafting, and so is the cost model of every chooser: what it measured of the models
    and the machine (costs, a model's acceptance) stays valid for the next prompt, and probing again every
    generation would cost rounds; a text's acceptance (prompt lookup's) starts again (`DraftCost.begin_generation`,
    called here: a generation begins on the stream). A slot's
    first cost model for these settings inherits the other slots' (`siblings`) verdict that drafting is hopeless
    and their measured prices, the draft step's and the verify's, not their acceptance (`DraftCost.inherit`).
    `pricing` attaches the drafter's rules to a cost model and returns its prices (`Drafter.pricing`)."""
    key = (drafting, greedy)
    found = kept.pop(key, None)
    if found is None:
        cost = DraftCost(drafting.n_draft, graphs=padded)
        cost.inherit(others[key].cost for others in siblings if key in others)
        found = DraftLength(drafting, cost, padded, pricing(cost))
    kept[key] = found
    while len(kept) > KEPT_POLICIES:
        del kept[next(iter(kept))]
    chosen = found if drafting.adaptive else DraftLength(drafting, found.cost, padded, pricing(found.cost))
    found.cost.begin_generation()  # (after `pricing`: every rule of the stream's drafter is attached)
    return chosen


class LoadPolicy:
    """How much of its draft length each stream drafts at the current batch size (several slots in one round).

    With many slots the target's verify grows towards compute-bound and draft tokens cost nearly what they save.
    So per batch size this measures the aggregate tokens per second of whole rounds at each share of the streams'
    own draft lengths in SHARES (none: plain batched decoding, half of it, all of it), an epoch each, then uses the
    fastest and re-measures the others in turn. A share that trails the best one measured at that size by more than
    DEFER ends its epoch after EARLY rounds, and a longer share is then not measured first at that size at all. A
    batch size next to one measured in full (`near`) measures its shares in the order they ranked there, and leaves a
    share that lost there by more than DEFER to its re-measuring epochs; so does a larger batch size for a drafting
    share (and the longer ones) that lost so at any smaller size: a larger batch's verify is nearer compute-bound,
    where drafts save less. As clients come and go a server sees many batch sizes, and measuring a clear loser for a
    whole epoch at each was most of what it lost under load (docs/performance.md).

    Re-measuring (acceptance drifts with the text) starts every REPROBE-th epoch; each time the share it measured
    loses again the gap to the next doubles, up to REPROBE_MAX (at 16 slots a round drafting all of its length cost
    about three plain ones on the hybrid target: re-measuring it every 8 epochs was ~5% of a long reply's time).

    One slot alone always drafts all of it: the single-request loop (and `localspec bench`'s modes) stays what it
    was, and a seed reproduces its output; so does a stream that may not stand aside (`[draft] stand_aside` off:
    `Schedule.plan` leaves its length alone).
    """

    EPOCH = 8
    EARLY = 3
    REPROBE = 8
    REPROBE_MAX = 64
    SHARES = (0.0, 0.5, 1.0)
    DEFER = 0.8  # a share below this part of the best ends its epoch early, and is left out at a neighbouring size

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}
        self.rate: dict[tuple[int, float], float] = {}  # (batch size, share) -> smoothed tokens per second
        self.order: dict[int, tuple[float, ...]] = {}  # per batch size: the shares it measures first, in turn
        self.epochs: dict[int, int] = {}  # per batch size: its epochs ended
        self.epoch_rounds: dict[int, int] = {}  # per batch size: rounds observed in its current epoch
        self.next_probe: dict[int, int] = {}  # per batch size: the epoch that re-measures a share other than the best
        self.probe_gap: dict[int, int] = {}  # per batch size: epochs from that one to the next
        self.probes: dict[int, int] = {}  # per batch size: re-measuring epochs so far (the others in turn)
        self.probing: dict[int, float] = {}  # per batch size: the share its re-measuring epoch under way measures

    @staticmethod
    def near(n: int, m: int) -> bool:
        """Whether batch size m is close enough to n for its ranking of the shares to stand for n's."""
        return 0 < abs(m - n) <= max(2, n // 4)

    def lost(self, m: int) -> set[float]:
        """The shares measured at batch size m that trail the best one there by more than DEFER."""
        rates = {f: r for (size, f), r in self.rate.items() if size == m}
        best = max(rates.values(), default=0.0)
        return {f for f, r in rates.items() if r < self.DEFER * best}

    def _first_order(self, n: int) -> tuple[float, ...]:
        """The shares a batch size measures first: SHARES in turn, or, next to a size measured in full, its
        ranking there without the shares that lost by more than DEFER; without a drafting share that lost so at a
        smaller size, nor any longer one."""
        full = [m for m in self.rounds if self.near(n, m) and all((m, f) in self.rate for f in self.SHARES)]
        ranked, out = list(self.SHARES), set()
        if full:
            m = min(full, key=lambda m: (abs(m - n), m))
            ranked = sorted(self.SHARES, key=lambda f: -self.rate[(m, f)])
            out = self.lost(m)
        below = [f for m in self.rounds if m < n for f in self.lost(m) if f > 0.0]
        kept = tuple(f for f in ranked if f not in out and not any(0.0 < g <= f for g in below))
        return kept or (ranked[0],)

    def share(self, n: int) -> float:
        """The share of each stream's draft length to draft this round, with n streams in it."""
        if n < 2:
            return 1.0
        order = self.order.setdefault(n, self._first_order(n))
        epoch = self.epochs.get(n, 0)
        if epoch < len(order):
            return order[epoch]
        best = self._best(n)
        # (a script may pin one share: bench/lab/slot_rounds.py)
        if len(self.SHARES) < 2 or epoch != self.next_probe.setdefault(n, max(self.REPROBE, len(order))):
            return best
        if n not in self.probing:  # (fixed for the epoch: the best may change under it)
            others = [f for f in self.SHARES if f != best]
            self.probing[n] = others[self.probes.get(n, 0) % len(others)]
        return self.probing[n]

    def _best(self, n: int) -> float:
        return max(self.SHARES, key=lambda f: self.rate.get((n, f), 0.0))

    def observe(self, n: int, share: float, tokens: int, seconds: float) -> None:
        if n < 2 or seconds <= 0.0:
            return
        self.rounds[n] = self.rounds.get(n, 0) + 1
        rate, key = tokens / seconds, (n, share)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else 0.8 * old + 0.2 * rate
        done = self.epoch_rounds[n] = self.epoch_rounds.get(n, 0) + 1
        trails = share in self.lost(n)
        if done < self.EPOCH and not (done >= self.EARLY and trails):
            return
        ended = self.epochs.get(n, 0)
        order = self.order.get(n, ())
        if ended >= len(order) and ended == self.next_probe.get(n):  # a re-measuring epoch
            self.probing.pop(n, None)
            self.probes[n] = self.probes.get(n, 0) + 1
            gap = self.probe_gap.get(n, self.REPROBE)
            gap = self.REPROBE if self._best(n) == share else min(2 * gap, self.REPROBE_MAX)
            self.probe_gap[n], self.next_probe[n] = gap, ended + gap
        elif ended < len(order) and share > 0.0 and trails:  # a longer share is left to the re-measuring epochs
            self.order[n] = order[: ended + 1] + tuple(f for f in order[ended + 1 :] if not f > share)
        self.epochs[n] = ended + 1
        self.epoch_rounds[n] = 0

    def summary(self) -> dict[int, dict[str, float]]:
        """Per batch size seen: the measured tok/s at each share of the draft length ("k×1", "k×0.5", "k×0": plain),
        for the server's /health."""
        return {n: {f"k×{f:g}": round(r, 1) for (m, f), r in sorted(self.rate.items()) if m == n}
                for n in sorted(self.rounds)}
