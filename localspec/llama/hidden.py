"""A model's hidden states, one row per decoded token (llama.cpp's NextN embeddings: the final norm's output), for
the drafters that read them (the MTP head). They come from llama-cpp-python's staging API (`llama_cpp_ext`) and a few
fields of its structs; an older build lacks them, and then MTP drafting is refused with one line (`mtp_unsupported`).
A sequence may ask for the inputs of some layers instead (a block drafter's features: `layer_features`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import DecodeError, ModelLoadError
from localspec.llama.batch import Run
from localspec.llama.layer_features import LayerFeatures
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
    """Which sequences of a context return hidden rows (NextN rows, or some layers' inputs), and copying them out
    of a decode."""

    def __init__(self, ctx: ctypes.c_void_p, n_embd_out: int, name: str, n_layer: int = 0, n_embd: int = 0) -> None:
        self._ctx = ctx
        self._n_embd = n_embd_out
        self._name = name  # the model file's name, for errors
        self._n_layer, self._n_embd_inp = n_layer, n_embd  # (a layer's input row: n_embd wide)
        self.seqs: set[int] = set()  # every sequence that wants rows, of either kind
        self._nextn: set[int] = set()
        self._layers: dict[int, LayerFeatures] = {}  # sequence -> the layers whose inputs it gets instead
        self._features: dict[tuple[int, ...], LayerFeatures] = {}  # one per layer set asked for, switched on in use

    def want(self, seq: int, on: bool, layers: Sequence[int] | None = None) -> None:
        """`layers`: the inputs of these layers instead of the NextN rows, one row a token of `len(layers) *
        n_embd` floats (`LayerFeatures`: what a block drafter's `fc` reads)."""
        was = bool(self._nextn)
        self.seqs.discard(seq)
        self._nextn.discard(seq)
        self._layers.pop(seq, None)
        if on and layers is not None:
            key = tuple(layers)
            if key not in self._features:
                self._features[key] = LayerFeatures(self._ctx, self._n_layer, self._n_embd_inp, key, self._name)
            self._layers[seq] = self._features[key]
            self.seqs.add(seq)
        elif on:
            if llama_cpp_ext is None:
                raise ModelLoadError(mtp_unsupported() or "no nextn embeddings in this llama-cpp-python")
            self._nextn.add(seq)
            self.seqs.add(seq)
        if bool(self._nextn) != was:  # (a context-wide switch: only when it changes)
            llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, bool(self._nextn), False)
        in_use = {id(f) for f in self._layers.values()}
        for features in self._features.values():  # (context-wide too: `switch` acts only on a change)
            features.switch(id(features) in in_use)

    def width(self, seq: int) -> int:
        """The floats of one of sequence `seq`'s rows (it wants rows)."""
        features = self._layers.get(seq)
        return self._n_embd if features is None else len(features.layers) * self._n_embd_inp

    def copy(self, runs: Sequence[Run], hidden: list[list[np.ndarray]]) -> None:
        """Each wanted item's hidden rows of the last decode (these runs): one per token, by batch index."""
        for features in {id(f): f for f in self._layers.values()}.values():
            features.copy(runs, {seq for seq, f in self._layers.items() if f is features}, hidden)
        if not self._nextn:
            return
        base = llama_cpp_ext.llama_get_embeddings_nextn(self._ctx)
        if not base:
            raise DecodeError(f"{self._name}: llama.cpp returned no hidden states")
        n = 0
        for run in runs:
            take = len(run.tokens)
            if run.item >= 0 and run.seq in self._nextn:
                rows = np.ctypeslib.as_array(base, shape=(n + take, self._n_embd))[n : n + take]
                hidden[run.item].append(rows[: take if run.real is None else run.real].copy())
            n += take
