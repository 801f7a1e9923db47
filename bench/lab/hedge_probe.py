"""Hedged bets at T = 0, before building them: what they could save, what they would cost, the round they predict.

    python bench/lab/hedge_probe.py --target T.gguf --draft D.gguf [--k 6] [--max-tokens 256] [--hedges 3]
        [--prompts shipped] [--threads N] [--bench-json localspec-t0.json] [--json OUT]

Drafting ahead beside the verify bets that every draft is accepted and that the target's next token is the draft's
argmax; on the card's pair at ~85% that bet came true in 72% of the rounds (445 of 620), and the other rounds
drafted their k tokens on the path: 3.9 of a round's 34.3 ms (docs/performance.md). A hedged bet would also draft
ahead, in the same batched draft decodes, the round that follows a rejection at the H positions where the draft
was least sure (its top-1 minus top-2 logit), taking the draft's runner-up there as the target's correction. This
probe measures the two figures that decide whether that pays, before any of it is built into the drafter:

1. coverage: the share of rounds such hedges would have saved. The greedy speculative loop (k drafts, a k + 1
   verify, no draft-ahead) runs the prompts; per round it records where the first rejection fell, the draft's margin
   at each drafted position and whether the target's correction there was the draft's runner-up. `--check`: the
   loop's output is plain greedy decoding's, token for token (exact on a CPU; a GPU's batch shapes move near ties).
2. the cost: a draft decode of one token for 1, 2, .., H + 1 sequences at once, alone (the ratio to one sequence
   is what each hedged draft step costs more).

`predict` then turns a measured round (the bench's JSON: `--bench-json`, the speculative runs' profile; or the
defaults, the H200 card pair at ~85%, T = 0) into the round with H hedges: the on-path drafting of the rounds the
hedges save is gone; every draft step beside the verify costs the batch ratio more, and the ahead thread already
ends at the verify's end (it waits for it: `ahead_wait_s`), so that extra is on the path. Prints a table; --json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402,F401,I001  -- before numpy (docs/gpu.md)

from localspec.sessions.bench import PROMPT_SETS  # noqa: E402
from localspec.llama.model import LlamaModel  # noqa: E402

# The H200 card pair at ~85%, T = 0 (docs/performance.md, "One GPU"): a round's ms and tokens, the bets kept
# (445 of 620), a draft step beside the verify (docs/architecture.md: 4.15 ms against 1.9 alone).
CARD_ROUND = {"round_ms": 34.27, "verify_ms": 29.29, "draft_ms": 3.91, "host_ms": 0.55, "wait_ms": 0.52,
              "tokens_per_round": 6.00, "bets_kept": 445 / 620, "contended_step_ms": 4.15}


@dataclasses.dataclass
class Rounds:
    """What the loop saw: per round, the first rejected position (None: all accepted), the correction's being the
    draft's runner-up there, and the rank of that position's margin among the round's drafts (1 = least sure)."""

    k: int
    rejected_at: list[int | None] = dataclasses.field(default_factory=list)
    runner_up: list[bool] = dataclasses.field(default_factory=list)
    margin_rank: list[int] = dataclasses.field(default_factory=list)
    tokens: int = 0

    def coverage(self, hedges: int) -> float:
        """The share of rounds a bet with `hedges` hedges at the least sure positions would have saved (beyond the
        plain bet's, which needs every draft accepted)."""
        saved = sum(1 for at, up, rank in zip(self.rejected_at, self.runner_up, self.margin_rank, strict=True)
                    if at is not None and up and rank <= hedges)
        return saved / len(self.rejected_at) if self.rejected_at else 0.0

    def summary(self, hedges: int) -> dict:
        n = len(self.rejected_at)
        rejected = [at for at in self.rejected_at if at is not None]
        return {"rounds": n, "tokens": self.tokens, "tokens_per_round": self.tokens / n if n else 0.0,
                "all_accepted": (n - len(rejected)) / n if n else 0.0,
                "rejected_at": {p: rejected.count(p) for p in range(1, self.k + 1)},
                "runner_up_when_rejected": sum(self.runner_up) / len(rejected) if rejected else None,
                "least_sure_when_rejected": (sum(1 for at, r in zip(self.rejected_at, self.margin_rank, strict=True)
                                                 if at is not None and r == 1) / len(rejected)) if rejected else None,
                "coverage": {h: self.coverage(h) for h in range(1, hedges + 1)}}


def predict(profile: dict, coverage: float, batch_ratio: float, k: int) -> dict:
    """The round with hedges, from a measured round without them (`profile`: `CARD_ROUND`'s keys).

    Saved: the on-path drafting of the rounds the hedges turn into kept bets (on-path drafting happens only in
    rounds whose bet failed: it scales with the failed share). Added: each of the ahead thread's k + 1 decodes costs
    `batch_ratio` times a contended step, and the thread already ends after the verify (it is waited for), so the
    whole extra is on the path."""
    failed = max(1.0 - profile["bets_kept"], 1e-9)
    saved = profile["draft_ms"] * min(coverage, failed) / failed
    added = max(0.0, batch_ratio - 1.0) * (k + 1) * profile["contended_step_ms"]
    round_ms = profile["round_ms"] - saved + added
    return {"round_ms": round_ms, "saved_ms": saved, "added_ms": added,
            "tok_s": 1000.0 * profile["tokens_per_round"] / round_ms,
            "vs_now": profile["round_ms"] / round_ms}


def profile_of(bench_json: Path) -> dict:
    """`CARD_ROUND`'s figures from a `localspec bench --json` report's speculative runs."""
    doc = json.loads(bench_json.read_text())
    runs = [r for r in doc["runs"] if r["mode"] == "speculative"]
    rounds = sum(r["rounds"] for r in runs)
    total = {key: sum(r.get(key, 0) for r in runs)
             for key in ("decode_s", "draft_s", "verify_s", "ahead_wait_s", "tokens", "ahead_made", "ahead_kept")}
    wait = total["ahead_wait_s"]
    return {"round_ms": 1000 * total["decode_s"] / rounds, "verify_ms": 1000 * total["verify_s"] / rounds,
            "draft_ms": 1000 * total["draft_s"] / rounds, "wait_ms": 1000 * wait / rounds,
            "host_ms": 1000 * (total["decode_s"] - total["draft_s"] - total["verify_s"] - wait) / rounds,
            "tokens_per_round": total["tokens"] / rounds,
            "bets_kept": total["ahead_kept"] / total["ahead_made"] if total["ahead_made"] else 0.0,
            "contended_step_ms": CARD_ROUND["contended_step_ms"]}


def run_rounds(target: LlamaModel, draft: LlamaModel, prompt: list[int], k: int, max_tokens: int,
               seen: Rounds) -> list[int]:
    """The greedy speculative loop, drafts from the draft's top-2 rows (sequence 0), the verify's argmax rows."""
    target.decode(prompt[:-1], 0)
    draft.decode(prompt[:-1], 0)
    tokens, draft_kv = list(prompt), len(prompt) - 1
    out: list[int] = []
    while len(out) < max_tokens:
        drafts, margins, runner_ups = [], [], []
        feed = tokens[draft_kv:]
        for _ in range(k):
            row = draft.decode(feed, draft_kv)
            assert row is not None and row.ids is not None and row.logits is not None
            draft_kv += len(feed)
            ids, logits = row.ids[0], row.logits[0]
            best, second = (0, 1) if logits[0] >= logits[1] else (1, 0)  # (the device's candidates need no order)
            drafts.append(int(ids[best]))
            runner_ups.append(int(ids[second]))
            margins.append(float(logits[best] - logits[second]))
            feed = [drafts[-1]]
        scores = target.decode([tokens[-1], *drafts], len(tokens) - 1, all_logits=True)
        assert scores is not None
        choice = [int(t) for t in scores.argmax()]
        n = 0
        while n < k and drafts[n] == choice[n]:
            n += 1
        emitted = [*drafts[:n], choice[n]]
        order = sorted(range(k), key=lambda p: margins[p])
        seen.rejected_at.append(n + 1 if n < k else None)
        seen.runner_up.append(n < k and runner_ups[n] == choice[n])
        seen.margin_rank.append(order.index(n) + 1 if n < k else 0)
        seen.tokens += len(emitted)
        target.truncate(len(tokens) + n)
        valid = len(tokens) + min(n, k - 1)  # the draft's cells: the committed tokens and the accepted drafts
        draft_kv = min(draft_kv, valid)
        draft.truncate(draft_kv)
        tokens += emitted
        out += emitted
    target.clear()
    draft.clear()
    return out[:max_tokens]


def plain(target: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    row = target.decode(prompt, 0)
    out = []
    while len(out) < max_tokens:
        assert row is not None
        out.append(int(row.argmax()[0]))
        row = target.decode([out[-1]], len(prompt) + len(out) - 1)
    target.clear()
    return out


def batch_cost(draft: LlamaModel, prompt: list[int], widths: int, calls: int) -> dict[int, float]:
    """ms of one draft decode of one token on each of n sequences at once, n = 1..widths (median of `calls`)."""
    for s in range(widths):
        draft.use_device_sampler(None, s)
    for s in range(widths):
        draft.decode(prompt, 0, seq=s)
    out = {}
    pos = len(prompt)
    for n in range(1, widths + 1):
        for s in range(widths):  # the device's top-2 on the sequences decoded, as a hedged bet would ask
            draft.use_device_sampler("top_k" if s < n else None, s)
        times = []
        for i in range(calls + 5):
            t = time.perf_counter()
            draft.decode_many([(s, [prompt[-1]], pos, False) for s in range(n)])
            if i >= 5:
                times.append(1000 * (time.perf_counter() - t))
            for s in range(n):
                draft.truncate(pos, s)
        out[n] = statistics.median(times)
    draft.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--hedges", type=int, default=3)
    p.add_argument("--prompts", default="shipped", choices=sorted(PROMPT_SETS))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--check", action="store_true", help="the loop's output against plain greedy decoding")
    p.add_argument("--bench-json", type=Path, help="a `localspec bench --json` report at T = 0 of the same pair")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    common = {"n_ctx": a.ctx, "n_threads": a.threads, "device_top_k": 2}
    with LlamaModel(a.target, **common) as target, LlamaModel(a.draft, n_seq=a.hedges + 1, **common) as draft:
        target.use_device_sampler("greedy")
        seen = Rounds(a.k)
        identical = []
        prompts = [target.tokenize(text, add_special=True) for _, text in PROMPT_SETS[a.prompts]]
        for prompt in prompts:
            draft.use_device_sampler("top_k", 0)
            got = run_rounds(target, draft, prompt, a.k, a.max_tokens, seen)
            if a.check:
                identical.append(got == plain(target, prompt, a.max_tokens))
        cost = batch_cost(draft, prompts[0], a.hedges + 1, a.calls)
    profile = profile_of(a.bench_json) if a.bench_json else dict(CARD_ROUND)
    stats = seen.summary(a.hedges)
    rows = {h: predict(profile, stats["coverage"][h], cost[h + 1] / cost[1], a.k) for h in range(1, a.hedges + 1)}
    print(f"{stats['rounds']} rounds, {stats['tokens_per_round']:.2f} tokens a round, all accepted in "
          f"{stats['all_accepted']:.1%}; first rejection at positions 1..{a.k}: {list(stats['rejected_at'].values())}")
    print(f"when rejected: the correction was the draft's runner-up in {stats['runner_up_when_rejected'] or 0:.1%}, "
          f"at the least sure position in {stats['least_sure_when_rejected'] or 0:.1%}")
    if identical:
        print(f"greedy check: {sum(identical)} of {len(identical)} prompts token-identical to plain decoding")
    print("draft decode of one token on n sequences at once: "
          + ", ".join(f"n={n} {ms:.3f} ms" for n, ms in cost.items()))
    print(f"round now ({'--bench-json' if a.bench_json else 'the H200 card pair at ~85%, T = 0'}): "
          f"{profile['round_ms']:.2f} ms, {1000 * profile['tokens_per_round'] / profile['round_ms']:.1f} tok/s")
    print(f"{'hedges':>6} {'coverage':>9} {'saved ms':>9} {'added ms':>9} {'round ms':>9} {'tok/s':>7} {'vs now':>7}")
    for h, r in rows.items():
        print(f"{h:>6} {stats['coverage'][h]:>9.1%} {r['saved_ms']:>9.2f} {r['added_ms']:>9.2f} "
              f"{r['round_ms']:>9.2f} {r['tok_s']:>7.1f} {r['vs_now']:>6.3f}x")
    if a.json:
        a.json.write_text(json.dumps({"rounds": stats, "batch_ms": cost, "profile": profile, "predicted": rows,
                                      "greedy_identical": identical, "args": {k: str(v) for k, v in vars(a).items()}},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
