"""What rolling back a hybrid model's recurrent state costs, through localspec's own llama.cpp wall.

    python bench/rollback_cost.py --model HYBRID.gguf [--k 6] [--reps 40] [--json out.json] [--threads N]

A hybrid target (Qwen3.5/3.6) rewinds rejected drafts through llama.cpp's snapshots of its recurrent state
(`n_rs_seq`, one per draft token, written by every verify) and, further back, through a checkpoint copy. Medians of
`--reps` rounds after a 512-token prompt, each with its own position (the cells grow by one a round):

- `verify_ms[w]`: a verify of w tokens with snapshots (n_rs_seq = k) and without (n_rs_seq = 0): the snapshots'
  upkeep, paid every round whether or not anything is rejected;
- `after_rollback_ms[j]`: a verify of k + 1 tokens, rolled back j of them, then the next one-token decode (which
  reads the snapshot); j = 0 is the same decode with nothing rolled back: the difference is the rollback's cost,
  `per_rejected_ms[j]` = (after_rollback_ms[j] - after_rollback_ms[0]) / j;
- `rollback_call_us`: `truncate` itself (the seq_rm and localspec's bookkeeping);
- `checkpoint_ms` / `restore_ms`: saving the recurrent state (on the device) and going back to it (the draft
  model's rewind, and a next prompt's).

On a CUDA machine import order matters (llama_cpp first: docs/gpu.md); this script does it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp  # noqa: F401,I001  -- before numpy (docs/gpu.md)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localspec.llama.model import LlamaModel  # noqa: E402

PROMPT = 512


def _median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 4)


def measure(path: Path, k: int, reps: int, threads: int, ngl: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    out: dict = {"model": path.name, "k": k, "reps": reps}
    for depth in (0, k):
        room = PROMPT + reps * ((k + 1) * (k + 2) // 2 + 3 * (k + 2)) + 64
        with LlamaModel(path, n_ctx=room, device_top_k=0, n_batch=512, n_threads=threads, n_gpu_layers=ngl,
                        rewind=depth) as m:
            vocab = min(m.n_vocab, 30_000)
            m.decode(rng.integers(100, vocab, size=PROMPT).tolist(), 0)
            pos = PROMPT
            times: dict[int, list[float]] = {w: [] for w in range(1, k + 2)}
            for _ in range(reps):
                for w in times:
                    toks = rng.integers(100, vocab, size=w).tolist()
                    t = time.perf_counter()
                    m.decode(toks, pos, all_logits=True)
                    times[w].append(time.perf_counter() - t)
                    if depth:  # keep one: the cells grow by a token a round
                        assert m.truncate(pos + 1) == pos + 1
                        pos += 1
                    else:  # nothing to roll back with: keep them all
                        pos += w
            out[f"verify_ms_rs{depth}"] = {w: _median_ms(v) for w, v in times.items()}
            if depth == 0:
                continue
            after: dict[int, list[float]] = {j: [] for j in range(0, k + 1)}
            calls: list[float] = []
            for _ in range(reps):
                for j in after:
                    toks = rng.integers(100, vocab, size=k + 1).tolist()
                    m.decode(toks, pos, all_logits=True)
                    keep = pos + k + 1 - j
                    t = time.perf_counter()
                    assert m.truncate(keep) == keep
                    calls.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    m.decode([int(rng.integers(100, vocab))], keep)
                    after[j].append(time.perf_counter() - t)
                    pos = keep + 1
            out["after_rollback_ms"] = {j: _median_ms(v) for j, v in after.items()}
            base = out["after_rollback_ms"][0]
            out["per_rejected_ms"] = {j: round((v - base) / j, 4) for j, v in out["after_rollback_ms"].items() if j}
            out["rollback_call_us"] = round(1e6 * statistics.median(calls), 1)
            saves, restores = [], []
            for _ in range(reps):
                t = time.perf_counter()
                m.checkpoint()
                saves.append(time.perf_counter() - t)
                toks = rng.integers(100, vocab, size=3).tolist()
                for i, tok in enumerate(toks):
                    m.decode([tok], pos + i)
                t = time.perf_counter()
                assert m.truncate(pos + 1) == pos  # past the one-token decodes: back to the checkpoint
                restores.append(time.perf_counter() - t)
            out["checkpoint_ms"] = _median_ms(saves)
            out["restore_ms"] = _median_ms(restores)
    out["snapshot_upkeep_ms"] = {w: round(out["verify_ms_rs" + str(k)][w] - out["verify_ms_rs0"][w], 4)
                                 for w in out["verify_ms_rs0"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--k", type=int, default=6, help="the draft length (snapshots kept)")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ngl", type=int, default=-1, help="layers on the GPU (-1: all)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    result = measure(a.model, a.k, a.reps, a.threads, a.ngl)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
