"""Whether a prompt's cells depend on the batch that decoded them, on this machine (CPU by default).

SmolLM2-135M-Instruct (the wheel's GGUF), the shipped prose prompt: its first 24 tokens are also the code-edit
prompt's. Decoded whole, and again after the first n tokens of the code edit were decoded in one batch and cut back
to the shared 24 (as a slot's earlier request or the prompt cache leaves them): how far apart the next token's logits
are, and whether the argmax moved. Prints one line per n (docs/lossless.md, docs/lab/2026-12-07-cpu-seeds-probes.md).

    python bench/lab/batch_cells.py [--sizes 33,63,64,186]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from localspec.config import load_preset
from localspec.models.demo import smollm2_source_path
from localspec.sessions import bench
from localspec.sessions.session import ModelFiles, open_session


@dataclass(frozen=True)
class Measured:
    prompt_tokens: int
    shared: int  # the prose prompt's first tokens that are also the code edit's
    alone_argmax: int
    alone_margin: float  # between its top two logits
    by_batch: dict[int, tuple[float, int]]  # batch size of the beginning -> (max |logit difference|, argmax)


def measure(sizes: list[int]) -> Measured:
    """The prose prompt alone, then after each of `sizes`: the code edit's first n tokens decoded in one batch and cut
    back to the shared beginning (one thread, greedy preset, full logits)."""
    preset = load_preset("greedy").with_overrides(n_ctx=1024, threads=1, drafter="lookup")
    files = ModelFiles(target=smollm2_source_path(), draft=None, name="smollm2")
    texts = {**dict(bench.PROMPTS), **dict(bench.LOOKUP_PROMPTS)}
    with open_session(files, preset) as s:
        prompts = dict(bench.tokenize_prompts(s, [bench.BenchPrompt(n, text=texts[n]) for n in ("prose", "code-edit")]))
        prose, edit = prompts["prose"], prompts["code-edit"]
        shared = next(i for i, (a, b) in enumerate(zip(prose, edit, strict=False)) if a != b)
        t = s.target
        t.use_device_sampler(None, 0)  # full logits
        fresh = t.decode(prose, 0, seq=0).logits[-1].copy()
        top = np.argsort(fresh)[::-1][:2]
        by_batch = {}
        for n in sizes:
            t.clear()
            t.decode(edit[:n], 0, seq=0)
            t.truncate(shared, 0)
            after = t.decode(prose[shared:], shared, seq=0).logits[-1]
            by_batch[n] = (float(np.abs(after - fresh).max()), int(after.argmax()))
    return Measured(len(prose), shared, int(top[0]), float(fresh[top[0]] - fresh[top[1]]), by_batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="33,63,64,186", help="batch sizes of the code edit's beginning to try")
    m = measure([int(x) for x in p.parse_args().sizes.split(",")])
    print(f"prose {m.prompt_tokens} tokens, {m.shared} shared with the code edit; alone: argmax {m.alone_argmax}, "
          f"margin {m.alone_margin:.3f}")
    for n, (diff, argmax) in m.by_batch.items():
        print(f"beginning decoded in a batch of {n}: max |logit difference| {diff:.4f}, argmax {argmax}")


if __name__ == "__main__":
    main()
