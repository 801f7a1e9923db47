"""Loading models through localspec.llama: the load-time sequence probe on any vocabulary, and a model as a process's
very first llama.cpp call."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers_vocab import N_TOKENS, base_vocab, write_vocab

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bos_last_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny pair whose vocabulary ends with its BOS (= EOS) token, as GPT-2-style vocabularies do."""
    from gguf import TokenType
    from synthetic import TINY, write_pair

    folder = tmp_path_factory.mktemp("bos-last")
    vocab = base_vocab()
    last = N_TOKENS - 1
    tokens = list(vocab["tokens"])
    tokens[last] = "<|endoftext|>"
    types = list(vocab["types"])
    types[last] = TokenType.CONTROL
    source = write_vocab(folder / "vocab.gguf", tokens=tokens, types=types, bos=last, eos=last)
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    write_pair(target, draft, dataclasses.replace(TINY, wtype="q4_0"), vocab_source=source)
    return target, draft


def test_the_sequence_probe_works_when_bos_is_the_last_id(bos_last_pair):
    from localspec.llama.model import LlamaModel

    with LlamaModel(bos_last_pair[0], n_ctx=64, n_seq=2, n_threads=1, devices=[]) as model:
        assert model.bos == model.n_vocab - 1
        assert model.sequence_batch_error == 0.0 and model.batches_sequences
        assert model.width_noise == 0.0  # on the CPU a sequence's rows do not depend on the batch's width
        # The GPU's comparison (a shared batch against each sequence alone at the same width) run here: a
        # Llama-style model shares exactly at any width, and the probe leaves both sequences empty.
        model.on_gpu = True
        assert model._sequence_batch_error() == (0.0, 0.0)
        assert model.decode([1, 2, 3], 0, all_logits=True) is not None  # from position 0: nothing was left behind


def test_a_gpu_shares_batches_despite_width_rounding_but_not_a_wrong_graph() -> None:
    """On a GPU every width change moves a real model's logits by 1-2 (docs/gpu.md): that alone must not make slots
    take turns, nor a shared batch that moves rows at the same width no more than the width itself does (the card-
    shaped stand-in: 61.8 against 77.5); a shared batch that moves them further does. The CPU demands bit for bit."""
    from localspec.llama.model import SEQUENCE_BATCH_NOISE, shares_batches

    assert shares_batches(True, 0.0, 2.3) and shares_batches(True, SEQUENCE_BATCH_NOISE, 0.0)
    assert shares_batches(True, 2.2, 2.2) and shares_batches(True, 61.8, 77.5)
    assert not shares_batches(True, 5.9, 2.2) and not shares_batches(True, SEQUENCE_BATCH_NOISE + 0.01, 0.0)
    assert not shares_batches(True, 2.21, 2.2)
    # the CPU's figure is against each sequence alone at its own width: any difference at all is too much
    assert shares_batches(False, 0.0, 0.0) and not shares_batches(False, 1e-6, 0.0)
    assert not shares_batches(False, 0.5, 0.0)



def test_a_model_is_the_first_thing_a_fresh_process_loads(bos_last_pair):
    """`LlamaModel(path)` before any device query: the backend and ggml's device registry are up before llama.cpp
    loads anything (on the H200 image this order crashed inside llama_model_load_from_file)."""
    code = ("import sys; from localspec.llama import backend, model; m = model.LlamaModel(sys.argv[1], n_ctx=64, "
            "n_threads=1, devices=[]); assert backend._ggml_lib is not None, 'no device registry'; "
            "print(m.n_vocab)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(bos_last_pair[0])], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(N_TOKENS)
