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

    with LlamaModel(bos_last_pair[0], n_ctx=64, device_top_k=0, n_seq=2, n_threads=1, devices=[]) as model:
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
    take turns, nor a shared batch that moves rows at the same width no more than the width itself does; a shared
    batch that moves them further does, and so does one past the preset's cap whatever the width noise (the
    card-shaped stand-in measured 61.8 against 77.5: its rows are rounding, not logits). The CPU demands bit for
    bit."""
    from localspec.config import load_preset
    from localspec.llama.model import SEQUENCE_BATCH_NOISE, shares_batches

    cap = load_preset().load.max_batch_error
    assert shares_batches(True, 0.0, 2.3, cap) and shares_batches(True, SEQUENCE_BATCH_NOISE, 0.0, cap)
    assert shares_batches(True, 2.2, 2.2, cap)
    assert not shares_batches(True, 5.9, 2.2, cap) and not shares_batches(True, SEQUENCE_BATCH_NOISE + 0.01, 0.0, cap)
    assert not shares_batches(True, 2.21, 2.2, cap)
    assert not shares_batches(True, 61.8, 77.5, cap)  # within its width noise, but past any rounding a draft survives
    assert not shares_batches(True, cap + 0.01, 2 * cap, cap) and shares_batches(True, cap, 2 * cap, cap)
    assert shares_batches(True, 61.8, 77.5, None)  # (no cap: the width noise alone decides)
    # the CPU's figure is against each sequence alone at its own width: any difference at all is too much
    assert shares_batches(False, 0.0, 0.0, cap) and not shares_batches(False, 1e-6, 0.0, cap)
    assert not shares_batches(False, 0.5, 0.0, cap)


def test_the_gpu_probe_compares_widths_of_one_kernel_regime(bos_last_pair, monkeypatch):
    """CUDA multiplies quantized weights with MMVQ kernels up to 8 tokens a batch and MMQ above (docs/gpu.md): the
    probe's shared batch is MMQ's, so every batch it compares with is too (the 5-token sequence alone is padded to
    9), and its width noise is rounding within one kernel, not the step between two. Run on the CPU, where the
    figures are 0, recording the widths of the batches the GPU's comparison decodes."""
    from localspec.llama.model import MMVQ_MAX_WIDTH, PROBE_WIDTH, LlamaModel

    with LlamaModel(bos_last_pair[0], n_ctx=64, device_top_k=0, n_seq=2, n_threads=1, devices=[]) as model:
        widths: list[int] = []
        decode = model._decode_batched

        def recorded(items, cover=False):  # type: ignore[no-untyped-def]
            if all(all_logits for _, _, _, all_logits in items):  # the compared rows (a context: no logits)
                widths.append(sum(len(tokens) for _, tokens, _, _ in items))
            return decode(items, cover)

        monkeypatch.setattr(model, "_decode_batched", recorded)
        model.on_gpu = True
        assert model._sequence_batch_error() == (0.0, 0.0)
        assert len(widths) == 5 and widths.count(PROBE_WIDTH) == 3  # shared; each alone as wide; each narrower
        assert min(widths) > MMVQ_MAX_WIDTH, widths


def test_health_warns_where_a_models_width_noise_defeats_speculation() -> None:
    """A model whose rows move past the cap with the batch width alone (the card-shaped stand-in: 77.5 logits) takes
    turns, and /health says in one line why speculation cannot work on it either; a model within it says nothing."""
    from starlette.testclient import TestClient

    from localspec.config import load_preset
    from localspec.llama.model import shares_batches, width_warning
    from localspec.server.app import ServerState, create_app
    from tests.helpers_serve import fake_backend

    cap = load_preset().load.max_batch_error
    assert width_warning(True, cap, cap) is None and width_warning(False, 77.5, cap) is None
    backend = fake_backend(slots=2)
    target = backend.worker.engine.target
    target.sequence_batch_error, target.width_noise = 61.8, 77.5  # what the probe measured on the H200
    target.batches_sequences = shares_batches(True, 61.8, 77.5, cap)
    target.batch_warning = width_warning(True, 77.5, cap)
    state = ServerState(model_id="fake")
    state.attach(backend)
    with TestClient(create_app(state), base_url="http://localhost") as client:
        slot_batches = client.get("/health").json()["slot_batches"]
    assert slot_batches["target"] == {
        "shared": False, "error": 61.8, "width_noise": 77.5, "sequences_per_call": None,  # (no call of several yet)
        "warning": f"this model's batch rows move 77.5 logits with the batch width alone (more than {cap:g}): its "
                   "verify rows are mostly kernel rounding, so draft acceptance will collapse"}
    assert slot_batches["draft"] == {"shared": True, "error": 0.0, "width_noise": 0.0, "sequences_per_call": None}


def test_a_model_is_the_first_thing_a_fresh_process_loads(bos_last_pair):
    """`LlamaModel(path)` before any device query: the backend and ggml's device registry are up before llama.cpp
    loads anything (on the H200 image this order crashed inside llama_model_load_from_file)."""
    code = ("import sys; from localspec.llama import backend, model; m = model.LlamaModel(sys.argv[1], n_ctx=64, "
            "device_top_k=0, n_threads=1, devices=[]); assert backend._ggml_lib is not None, 'no device registry'; "
            "print(m.n_vocab)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(bos_last_pair[0])], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(N_TOKENS)
