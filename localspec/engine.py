"""The speculative loop. It yields events and never prints.

One generation: `_prefill` the prompt into both KV caches (reusing whatever prefix they already hold), then rounds
of `_draft` (up to k tokens, one draft decode each), `_verify` (one batched target decode with logits at every
drafted position), acceptance (greedy match or rejection sampling), and `_rewind` (the one place KV cells of
rejected tokens are removed from both caches). k = 0 is plain decoding through the same code, so baselines are
apples to apples.

Bookkeeping invariant between rounds: `self._tokens` is the committed sequence; the target's KV cache holds all of
it except the last token (`cur`), which opens the next verify batch; the draft's KV cache holds a prefix of it and
catches up at the start of its next `_draft`.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from localspec.config import Drafting, Sampling
from localspec.llama_ctx import LlamaModel, TopK
from localspec.sampling import (
    Candidates,
    accept_or_resample,
    apply_repeat_penalty,
    candidates,
    candidates_from_top_k,
)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    text: str  # the UTF-8 text this token completes (may be "" mid-character)
    from_draft: bool  # True when the token is an accepted draft token


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_tokens_processed: int = 0  # the part of the prompt not already in the KV caches
    prefill_s: float = 0.0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # inside llama_decode of the draft (including logits sync)
    verify_s: float = 0.0  # inside llama_decode of the target
    decode_s: float = 0.0  # wall time of all rounds
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def host_s(self) -> float:
        """Everything in the rounds that is not a llama_decode: sampling, acceptance, bookkeeping."""
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per round (each round also emits one token of the target's own)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens_processed / self.prefill_s if self.prefill_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        keys = ("prompt_tokens", "prompt_tokens_processed", "prefill_s", "tokens", "rounds", "drafted",
                "accepted", "draft_s", "verify_s", "decode_s", "host_s", "acceptance_rate", "mean_accepted",
                "decode_tps", "prefill_tps")
        return {k: getattr(self, k) for k in keys}


STOP_EOG = "eog"
STOP_MAX_TOKENS = "max_tokens"
STOP_CONTEXT_FULL = "context_full"


@dataclass(frozen=True, slots=True)
class DoneEvent:
    stats: GenerationStats
    stop_reason: str  # STOP_EOG, STOP_MAX_TOKENS or STOP_CONTEXT_FULL
    message: str


Event = TokenEvent | DoneEvent


class _DraftLength:
    """Chooses k for the next round: fixed, or adaptive from measured costs and recent acceptance.

    Adaptive picks the k that maximises expected tokens per second, E[tokens | k] / cost(k), where a round with
    per-token acceptance a yields (1 − a^(k+1)) / (1 − a) tokens and costs k draft steps plus a verify whose time
    grows with its width. Both are measured online (exponential moving averages), so it adapts to the machine.
    """

    def __init__(self, cfg: Drafting) -> None:
        self.k_max = cfg.n_draft
        self.adaptive = cfg.adaptive and cfg.n_draft > 0
        self.acceptance = 0.7  # prior until rounds are measured
        self.draft_step_s = 0.0
        self.verify_s: dict[int, float] = {}

    def next(self) -> int:
        if not self.adaptive or self.draft_step_s == 0.0 or not self.verify_s:
            return self.k_max
        a = min(self.acceptance, 0.999)
        best_k, best_rate = self.k_max, 0.0
        for k in range(1, self.k_max + 1):
            expected = (1 - a ** (k + 1)) / (1 - a)
            rate = expected / (k * self.draft_step_s + self._verify_cost(k))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _verify_cost(self, k: int) -> float:
        if k in self.verify_s:
            return self.verify_s[k]
        # Linear fit through the widths seen so far; one width alone means a flat cost.
        ks = np.array(sorted(self.verify_s))
        ts = np.array([self.verify_s[x] for x in ks])
        if len(ks) == 1:
            return float(ts[0])
        slope, intercept = np.polyfit(ks, ts, 1)
        return float(max(intercept + slope * k, ts.min()))

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if not self.adaptive:
            return
        ema = 0.2
        if drafted:
            self.acceptance = (1 - ema) * self.acceptance + ema * (accepted / drafted)
            step = draft_s / drafted
            self.draft_step_s = step if self.draft_step_s == 0.0 else (1 - ema) * self.draft_step_s + ema * step
        old = self.verify_s.get(drafted)
        self.verify_s[drafted] = verify_s if old is None else (1 - ema) * old + ema * verify_s


class Engine:
    """Speculative decoding over a target and an optional draft `LlamaModel` (same tokenizer)."""

    def __init__(self, target: LlamaModel, draft: LlamaModel | None) -> None:
        self.target = target
        self.draft = draft
        self._target_kv: list[int] = []  # tokens in the target's KV cache, position by position
        self._draft_kv: list[int] = []
        self._tokens: list[int] = []
        self._draft_unknown = 0 if draft is None else draft.unknown_token

    # -- public ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget both KV caches (the next prompt is processed in full)."""
        self.target.clear()
        self._target_kv = []
        if self.draft is not None:
            self.draft.clear()
        self._draft_kv = []
        self._tokens = []

    @property
    def n_ctx(self) -> int:
        return min(self.target.n_ctx, self.draft.n_ctx) if self.draft is not None else self.target.n_ctx

    def generate(self, prompt: Sequence[int], sampling: Sampling, drafting: Drafting,
                 max_tokens: int) -> Iterator[Event]:
        """Yield a TokenEvent per emitted token, then one DoneEvent with the stats and why it stopped."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token (a BOS token will do)")
        stats = GenerationStats(prompt_tokens=len(prompt))
        use_draft = self.draft is not None and drafting.n_draft > 0
        rng = np.random.default_rng(sampling.seed)
        chooser = _DraftLength(drafting if use_draft else Drafting(n_draft=0, p_min=0.0, adaptive=False))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        # Device top-k serves greedy decoding and any top-k pipeline it covers; a repetition penalty needs the
        # penalised tokens' logits wherever they rank, so it takes full rows.
        for model in (self.target, self.draft):
            if model is not None and model.device_top_k:
                model.use_device_top_k(sampling.greedy or (
                    sampling.repeat_penalty == 1.0 and 0 < sampling.top_k <= model.device_top_k))

        t0 = time.perf_counter()
        self._prefill(list(prompt), use_draft, stats)
        stats.prefill_s = time.perf_counter() - t0

        stop, message = STOP_MAX_TOKENS, f"reached max_tokens ({max_tokens})"
        t_start = time.perf_counter()
        while stats.tokens < max_tokens:
            room = self.n_ctx - len(self._tokens)  # verify needs cur + k cells after the cached prefix
            if room < 0 or len(self._target_kv) + 1 > self.target.n_ctx:
                stop, message = STOP_CONTEXT_FULL, f"context full ({self.n_ctx} tokens): start a new conversation"
                break
            k = min(chooser.next(), max_tokens - stats.tokens - 1, room) if use_draft else 0
            drafts, q, draft_s = self._draft(k, sampling, drafting, rng) if k > 0 else ([], None, 0.0)
            emitted, n_accepted, verify_s = self._verify(drafts, q, sampling, rng)
            self._rewind(drafts, n_accepted, emitted[-1])
            chooser.observe(len(drafts), n_accepted, draft_s, verify_s)
            stats.draft_s += draft_s
            stats.verify_s += verify_s
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += n_accepted
            stats.draft_lengths.append(len(drafts))

            finished = False
            for i, token in enumerate(emitted):
                if self.target.is_eog(token):
                    stop, message, finished = STOP_EOG, "end of generation", True
                    break
                stats.tokens += 1
                yield TokenEvent(token, decoder.decode(self.target.piece(token)), i < n_accepted)
                if stats.tokens >= max_tokens:
                    finished = True
                    break
            if finished:
                break
        stats.decode_s = time.perf_counter() - t_start
        yield DoneEvent(stats, stop, message)

    # -- the loop's steps -----------------------------------------------------------------------------------

    def _prefill(self, prompt: list[int], use_draft: bool, stats: GenerationStats) -> None:
        """Bring both caches to prompt[:-1], keeping the longest prefix they already share with it."""
        if len(prompt) > self.n_ctx:
            from localspec.errors import ContextFullError

            raise ContextFullError(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx}")
        body = prompt[:-1]
        stats.prompt_tokens_processed = self._sync(self.target, self._target_kv, body)
        if use_draft:
            self._sync(self.draft, self._draft_kv, body)
        self._tokens = list(prompt)

    @staticmethod
    def _sync(model: LlamaModel, kv: list[int], wanted: list[int]) -> int:
        """Make `kv` (and the model's cache) equal `wanted`; returns how many tokens had to be decoded."""
        keep = 0
        for a, b in zip(kv, wanted, strict=False):
            if a != b:
                break
            keep += 1
        if keep < len(kv):
            model.truncate(keep)
            del kv[keep:]
        todo = wanted[keep:]
        if todo:
            model.decode(todo, keep)
            kv.extend(todo)
        return len(todo)

    def _draft(self, k: int, sampling: Sampling, drafting: Drafting,
               rng: np.random.Generator) -> tuple[list[int], list[Candidates] | None, float]:
        """Up to k draft tokens, one draft decode each; the draft's distributions when sampling; seconds."""
        draft = self.draft
        assert draft is not None
        feed = self._tokens[len(self._draft_kv) :]  # cur, plus the last draft token after an all-accept round
        if max(feed) >= draft.n_vocab:
            # A target-only padding id (vocabularies may differ by up to 128 trailing ids): the draft sees its
            # unknown token there instead. That can only cost acceptance, never correctness.
            feed = [t if t < draft.n_vocab else self._draft_unknown for t in feed]
        drafts: list[int] = []
        dists: list[Candidates] = []
        spent = 0.0
        for step in range(k):
            t = time.perf_counter()
            scores = draft.decode(feed, len(self._draft_kv))
            spent += time.perf_counter() - t
            self._draft_kv.extend(feed)
            if sampling.greedy:
                token = int(_argmax(scores)[0])
                confident = drafting.p_min == 0.0 or _top_softmax(scores) >= drafting.p_min
            else:
                dist = _distributions(scores, self._tokens + drafts, sampling)
                token = dist.sample(0, rng)
                dists.append(dist)
                confident = drafting.p_min == 0.0 or dist.top_prob(0) >= drafting.p_min
            if token >= self.target.n_vocab:
                break  # a draft-only padding id: the target cannot score it
            drafts.append(token)
            feed = [token]
            if not confident and step < k - 1:
                break  # an unsure draft is usually wrong: verify what we have instead of drafting on
        return drafts, (None if sampling.greedy else dists), spent

    def _verify(self, drafts: list[int], q: list[Candidates] | None, sampling: Sampling,
                rng: np.random.Generator) -> tuple[list[int], int, float]:
        """One target decode of [cur] + drafts; returns (tokens to emit, accepted count, verify seconds)."""
        batch = [self._tokens[-1], *drafts]
        t = time.perf_counter()
        scores = self.target.decode(batch, len(self._target_kv), all_logits=True)
        spent = time.perf_counter() - t
        self._target_kv.extend(batch)

        if sampling.greedy:
            choice = _argmax(scores)
            n = 0
            while n < len(drafts) and drafts[n] == choice[n]:
                n += 1
            return [*drafts[:n], int(choice[n])], n, spent

        p = _distributions(scores, self._tokens + drafts, sampling)
        for i, token in enumerate(drafts):
            ok, out = accept_or_resample(token, p, i, q[i], rng)
            if not ok:
                return [*drafts[:i], out], i, spent
        return [*drafts, p.sample(len(drafts), rng)], len(drafts), spent

    def _rewind(self, drafts: list[int], n_accepted: int, next_token: int) -> None:
        """Drop the KV cells of rejected tokens from both caches and commit the round's tokens."""
        keep = len(self._tokens) + n_accepted  # committed tokens (cur included) + accepted drafts
        if len(self._target_kv) > keep:
            self.target.truncate(keep)
            del self._target_kv[keep:]
        if len(self._draft_kv) > keep:
            self.draft.truncate(keep)
            del self._draft_kv[keep:]
        self._tokens.extend(drafts[:n_accepted])
        self._tokens.append(next_token)


def _argmax(scores: np.ndarray | TopK) -> np.ndarray:
    """The greedy token of every row, from full logits or from the device's top-k candidates."""
    return scores.argmax() if isinstance(scores, TopK) else np.argmax(scores, axis=1)


def _distributions(scores: np.ndarray | TopK, history: list[int], sampling: Sampling) -> Candidates:
    """The sampling pipeline for every row; row i's repetition penalty sees the history plus rows before it."""
    if isinstance(scores, TopK):  # only chosen when no penalty applies (see generate)
        return candidates_from_top_k(scores.ids, scores.logits, sampling)
    if sampling.repeat_penalty != 1.0:
        base = len(history) - len(scores) + 1  # row i follows history[:base + i]
        scores = np.stack([apply_repeat_penalty(row, history[: base + i], sampling) for i, row in enumerate(scores)])
    return candidates(scores, sampling)


def _top_softmax(scores: np.ndarray | TopK) -> float:
    """The draft's top probability at temperature 1, for the p_min early stop of greedy drafts. With device
    top-k it is taken over the candidates only (an overestimate, fine for a stopping heuristic)."""
    row = scores.logits[0] if isinstance(scores, TopK) else scores[0]
    return 1.0 / float(np.exp(row - row.max(), dtype=np.float64).sum())
