"""What the MTP head and the recurrent rewind rely on in llama-cpp-python, checked on the real library
(docs/upstream.md):

- the masked-rows bug is still there (`MtpHead` asks every entry's NextN row because llama.cpp's "masked" rows are the
  batch's first rows, not its outputs'): the day upstream fixes it this fails, and the workaround can go;
- no enum value stands in for one the library does not declare (a guessed value would go wrong silently the day
  llama.h renumbers it): a build that lacks one is refused with a line naming it, and so is a build without MTP
  support, naming the library and what it lacks, never blaming the model file.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import llama_cpp  # noqa: I001  -- before numpy (docs/gpu.md)
import numpy as np
import pytest

from localspec.config import load_preset
from localspec.errors import ModelLoadError, RollbackError, UsageError
from localspec.rounds.engine import Engine

GREEDY = load_preset("greedy").with_overrides(threads=1)
VERSION = f"llama-cpp-python {llama_cpp.__version__} (the workaround was written against 0.3.36)"


@pytest.mark.slow
def test_masked_nextn_rows_are_still_the_batchs_first_rows(hybrid_pair) -> None:
    """bench/repro_mtp_masked_rows.py's case: 4 entries, only the last an output; masked, its NextN row is entry 0's."""
    from repro_mtp_masked_rows import ENTRIES, rows

    from localspec.llama.model import LlamaModel

    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1) as m:
        assert m.mtp_layers == 1
        n_embd = int(llama_cpp.llama_model_n_embd_out(m.model))
        h = np.random.default_rng(0).standard_normal((ENTRIES, n_embd)).astype(np.float32)
        tokens = [100 + 7 * i for i in range(ENTRIES)]
        masked = rows(m.model, 1, True, h, tokens)
        unmasked, first = rows(m.model, 1, False, h, tokens)
    assert np.allclose(masked, first, atol=1e-5) and not np.allclose(masked, unmasked, atol=1e-5), (
        f"{VERSION}: an MTP context's masked NextN row of a batch's only output is that entry's own row now. "
        "llama.cpp may have fixed the bug localspec/llama/mtp_head.py works around by reading every entry's row "
        "(docs/upstream.md): check the fix upstream, then let MtpHead ask masked rows and drop this test.")


def test_no_enum_value_stands_in_for_one_the_library_lacks() -> None:
    """Every llama.cpp name localspec/llama reads is read from the library (`llama_cpp.NAME`), never
    `getattr(llama_cpp, NAME, value)`: a build that lacks it is refused by name instead (the tests below)."""
    root = Path(__file__).resolve().parent.parent / "localspec"
    stand_ins = [f"{path.relative_to(root.parent)}: {m.group(0)}" for path in root.rglob("*.py")
                 for m in re.finditer(r"getattr\(llama_cpp, \"[A-Z_]+\", [^)]+\)", path.read_text())]
    assert not stand_ins


@pytest.mark.parametrize("name", ["LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE",
                                  "llama_state_seq_set_data_ext"])
def test_a_build_without_recurrent_checkpoints_is_refused_by_name(hybrid_pair, monkeypatch, name) -> None:
    from localspec.llama.model import LlamaModel
    from localspec.llama.recurrent import rollback_unsupported

    assert rollback_unsupported() is None  # the pinned build has all of it
    monkeypatch.delattr(llama_cpp, name)
    assert name in (rollback_unsupported() or "")
    with pytest.raises(RollbackError, match=rf"{hybrid_pair[0].name}: llama-cpp-python .* lacks {name}"):
        LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=3)


@pytest.mark.parametrize("name", ["LLAMA_CONTEXT_TYPE_MTP", "llama_batch_ext_set_embd_token"])
def test_a_library_without_mtp_support_is_named_not_the_model_file(hybrid_pair, monkeypatch, name) -> None:
    """The hybrid target has an MTP block; a library that cannot run it loads the model without it, and the drafter's
    refusal says the library lacks MTP support and what it lacks, not that the GGUF has no MTP layers."""
    from localspec.llama.hidden import mtp_unsupported
    from localspec.llama.model import LlamaModel
    from localspec.llama.mtp_head import MtpHead

    assert mtp_unsupported() is None
    monkeypatch.delattr(llama_cpp, name)
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=3) as target:
        assert target.mtp_layers == 0
        engine = Engine(target, None)
        with pytest.raises(UsageError) as err:
            engine.check_drafter(dataclasses.replace(GREEDY.draft, drafter="mtp", n_draft=3))
        message = str(err.value)
        assert f"{hybrid_pair[0].name} has MTP layers, but the llama.cpp library (llama-cpp-python " in message
        assert f"has no MTP support: it lacks {name}" in message
        assert "GGUF has no" not in message
        with pytest.raises(ModelLoadError, match=f"lacks {name}"):
            MtpHead(target, n_ctx=256)
        engine.close()
