"""A model's hidden states, one row per decoded token (llama.cpp's NextN embeddings: the final norm's output), for
the drafters that read them (the MTP head). They come from llama-cpp-python's staging API (`llama_cpp_ext`) and a few
fields of its structs; an older build lacks them, and then MTP drafting is refused with one line (`mtp_unsupported`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import DecodeError, ModelLoadError
from localspec.llama.batch import Run
from localspec.llama.recurrent import has_field

try:
    from llama_cpp import llama_cpp_ext
except (ImportError, AttributeError):  # an older build: no staging API (MTP heads unavailable)
    llama_cpp_ext = None  # type: ignore[assignment]


def mtp_unsupported() -> str | None:
    """Why this llama-cpp-python cannot run a model's MTP head (the library, not the model file: it names what the
    library lacks), None if it can."""
    missing = [name for name, have in (
        ("llama_cpp.llama_cpp_ext", llama_cpp_ext is not None),
        ("llama_model_params.load_mtp", has_field(llama_cpp.llama_model_params, "load_mtp")),
        ("llama_context_params.ctx_type", has_field(llama_cpp.llama_context_params, "ctx_type")),
        ("LLAMA_CONTEXT_TYPE_MTP", hasattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP")),
        ("llama_process", hasattr(llama_cpp, "llama_process")),
        ("llama_batch_ext_set_embd_token", hasattr(llama_cpp, "llama_batch_ext_set_embd_token")),
    ) if not have]
    if not missing:
        return None
    return (f"the llama.cpp library (llama-cpp-python {getattr(llama_cpp, '__version__', '?')}) has no MTP support: "
            f"it lacks {', '.join(missing)}; install llama-cpp-python 0.3.36 or newer")


class HiddenRows:
    """Which sequences of a context return hidden rows, and copying them out of a decode."""

    def __init__(self, ctx: ctypes.c_void_p, n_embd_out: int, name: str) -> None:
        self._ctx = ctx
        self._n_embd = n_embd_out
        self._name = name  # the model file's name, for errors
        self.seqs: set[int] = set()

    def want(self, seq: int, on: bool) -> None:
        was = bool(self.seqs)
        if on:
            if llama_cpp_ext is None:
                raise ModelLoadError(mtp_unsupported() or "no nextn embeddings in this llama-cpp-python")
            self.seqs.add(seq)
        else:
            self.seqs.discard(seq)
        if bool(self.seqs) != was:  # (a context-wide switch: only when it changes)
            llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, bool(self.seqs), False)

    def copy(self, runs: Sequence[Run], hidden: list[list[np.ndarray]]) -> None:
        """Each wanted item's hidden rows of the last decode (these runs): one per token, by batch index."""
        base = llama_cpp_ext.llama_get_embeddings_nextn(self._ctx)
        if not base:
            raise DecodeError(f"{self._name}: llama.cpp returned no hidden states")
        n = 0
        for run in runs:
            take = len(run.tokens)
            if run.item >= 0 and run.seq in self.seqs:
                rows = np.ctypeslib.as_array(base, shape=(n + take, self._n_embd))[n : n + take]
                hidden[run.item].append(rows[: take if run.real is None else run.real].copy())
            n += take
