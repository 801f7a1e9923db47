"""The target's layer-input features for block drafters (DFlash, DSpark; docs/dflash.md): llama.cpp's llama-ext.h
calls that switch a context's layer inputs on and read them back, and the drafter GGUF's target layers, bound with
ctypes on llama-cpp-python's loaded library (it does not bind them). A library without one of them refuses these
drafters with one line naming the symbol (`layer_features_unsupported`). Also the header check a block drafter's
pair passes before anything loads (`check_block_drafter`): llama.cpp aborts the process, not returns an error, on
a layer its target's graph does not capture.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp  # noqa: I001  -- llama_cpp before numpy: on CUDA builds the other order can segfault (docs/gpu.md)
import numpy as np

from localspec.errors import DecodeError, ModelLoadError, UsageError
from localspec.llama.batch import Run
from localspec.models.gguf_header import GGUFHeader

try:
    from llama_cpp import llama_cpp_ext
except (ImportError, AttributeError):  # an older build: no staging API (DSpark's confidence rows need it)
    llama_cpp_ext = None  # type: ignore[assignment]

_ctx_p = llama_cpp.llama_context_p_ctypes
_model_p = llama_cpp.llama_model_p_ctypes

# Each function under the names libllama may export it as: llama-ext.h declares them without extern "C", so a GCC or
# Clang build exports the Itanium-mangled name, an MSVC build its own, and a future build may make them C.
_SIGNATURES: dict[str, tuple[tuple[str, ...], list[Any], Any]] = {
    "llama_set_embeddings_layer_inp": (
        ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
         "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
        [_ctx_p, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": (
        ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
         "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
        [_ctx_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "llama_model_target_layer_ids_n": (
        ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
         "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
        [_model_p], ctypes.c_uint32),
    "llama_model_target_layer_ids": (
        ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
         "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
        [_model_p], ctypes.POINTER(ctypes.c_int32)),
    "llama_model_dflash_selector_top_k": (
        ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model",
         "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
        [_model_p], ctypes.c_int32),
}


def _bind(names: Sequence[str], argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    lib = llama_cpp.llama_cpp._lib  # the library llama-cpp-python loaded (its own bindings use it)
    for name in names:
        func = getattr(lib, name, None)
        if func is not None:
            func.argtypes = argtypes
            func.restype = restype
            return func  # type: ignore[no-any-return]
    return None


_BOUND: dict[str, Callable[..., Any] | None] = {name: _bind(*sig) for name, sig in _SIGNATURES.items()}


def layer_features_unsupported() -> str | None:
    """Why this llama.cpp library cannot feed a block drafter (the symbols it lacks), None if it can."""
    missing = [name for name, func in _BOUND.items() if func is None]
    missing += [name for name in ("llama_batch_ext_add_embd", "llama_process") if not hasattr(llama_cpp, name)]
    if llama_cpp_ext is None:
        missing.append("llama_cpp.llama_cpp_ext")
    if not missing:
        return None
    return (f"the llama.cpp library (llama-cpp-python {getattr(llama_cpp, '__version__', '?')}) lacks "
            f"{', '.join(missing)}: this llama.cpp build cannot give a drafter the target's layer features; "
            "install llama-cpp-python 0.3.36 or newer")


def _fn(name: str) -> Callable[..., Any]:
    func = _BOUND[name]
    if func is None:
        raise ModelLoadError(f"the llama.cpp library (llama-cpp-python {getattr(llama_cpp, '__version__', '?')}) "
                             f"lacks {name}: this llama.cpp build cannot give a drafter the target's layer features")
    return func


# -- the calls --------------------------------------------------------------------------------------------------


def set_embeddings_layer_inp(ctx: Any, layer: int, on: bool) -> None:
    """Whether `ctx`'s decodes keep layer `layer`'s input rows. llama.cpp asserts (aborts) on a layer above the
    model's n_layer and, at the next decode, on one its graph does not capture: callers check first
    (`LayerFeatures`, `check_block_drafter`)."""
    _fn("llama_set_embeddings_layer_inp")(ctx, layer, on)


def get_embeddings_layer_inp(ctx: Any, layer: int) -> Any:
    """The last decode's rows of layer `layer`'s input (n_embd floats a token, every token of the batch), a
    pointer into llama.cpp's buffer (valid until the next decode). llama.cpp asserts (aborts) on a layer that was
    not switched on."""
    return _fn("llama_get_embeddings_layer_inp")(ctx, layer)


def target_layer_ids(model: Any) -> list[int]:
    """A drafter model's target layers (its GGUF's `target_layers`), [] for a model without them."""
    n = int(_fn("llama_model_target_layer_ids_n")(model))
    if n == 0:
        return []
    ids = _fn("llama_model_target_layer_ids")(model)
    return [int(ids[i]) for i in range(n)]


def dflash_selector_top_k(model: Any) -> int:
    """A DFlash2 drafter's selector top-k (0: not DFlash2)."""
    return int(_fn("llama_model_dflash_selector_top_k")(model))


# -- a target context's features --------------------------------------------------------------------------------


class LayerFeatures:
    """Which layers' inputs a target context keeps, and a decode's rows of them, concatenated per token in the
    drafter's order (one `len(layers) * n_embd` row a token: what its `fc` reads)."""

    def __init__(self, ctx: Any, n_layer: int, n_embd: int, layers: Sequence[int], name: str) -> None:
        bad = [i for i in layers if not 0 <= i < n_layer]
        if not layers or bad:
            raise UsageError(f"{name}: layer features of layers {list(layers)} asked of a model with {n_layer} "
                             f"layers (0..{n_layer - 1})")
        self._ctx = ctx
        self._n_embd = n_embd
        self.layers = tuple(layers)
        self._name = name
        self.on = False

    @property
    def width(self) -> int:
        return len(self.layers) * self._n_embd

    def switch(self, on: bool) -> None:
        """Switch the layers on or off (each switch makes llama.cpp reserve its graphs again: only when it changes)."""
        if on == self.on:
            return
        for layer in sorted(set(self.layers)):
            set_embeddings_layer_inp(self._ctx, layer, on)
        self.on = on

    def rows(self, first: int, count: int) -> np.ndarray:
        """Rows first.. of the last decode (batch order within a ubatch, ubatch after ubatch), a copy:
        (count, width) float32."""
        if not self.on:
            raise DecodeError(f"{self._name}: layer features were not switched on before the decode")
        out = np.empty((count, self.width), dtype=np.float32)
        for k, layer in enumerate(self.layers):
            base = get_embeddings_layer_inp(self._ctx, layer)
            if not base:
                raise DecodeError(f"{self._name}: llama.cpp returned no input rows of layer {layer}")
            view = np.ctypeslib.as_array(base, shape=(first + count, self._n_embd))
            out[:, k * self._n_embd : (k + 1) * self._n_embd] = view[first : first + count]
        return out

    def copy(self, runs: Sequence[Run], wanted: set[int], out: list[list[np.ndarray]]) -> None:
        """Each wanted sequence's rows of the last decode (these runs), one per token, by batch index: the layout
        `hidden.HiddenRows.copy` reads NextN rows in."""
        n = 0
        for run in runs:
            take = len(run.tokens)
            if run.item >= 0 and run.seq in wanted:
                out[run.item].append(self.rows(n, take if run.real is None else run.real))
            n += take


# -- a block drafter's own context ----------------------------------------------------------------------------


class BlockContext:
    """A block drafter's context (its GGUF loaded over the target: `LlamaModel(other=target)`): the target's features
    injected into its cells at their positions, and blocks `[cur, MASK ...]` decoded, through llama-cpp-python's
    batch_ext API (an embd batch of feature rows; a token batch of blocks), as common/speculative.cpp's loop does.
    Every decode stays within the context's batch: with attention both ways llama.cpp aborts on a wider one."""

    def __init__(self, model: Any, facts: BlockDrafterFacts) -> None:
        self._model = model  # the drafter's LlamaModel
        self._ctx = model.ctx
        self.facts = facts
        self._n_vocab = int(model.n_vocab)
        self._n_embd = int(llama_cpp.llama_model_n_embd(model.model))
        self.width = len(facts.layers) * self._n_embd  # a feature row: what `fc` reads
        self.offset = 0 if facts.from_anchor else 1  # the block's first row that drafts
        self.block = facts.max_drafts + self.offset  # its tokens: the trained block, always whole
        self._pos = llama_cpp.llama_pos(0)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        if not self._batch:
            raise ModelLoadError(f"{model.path.name}: llama.cpp could not make the drafter's batch")
        llama_cpp.llama_set_causal_attn(self._ctx, facts.causal)  # (both ways unless the drafter was trained causal)
        if facts.confidence:  # DSpark's confidence per block row comes back as its nextn rows (output rows only)
            llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, True)

    def inject(self, seq: int, first: int, rows: np.ndarray) -> None:
        """Feature rows (n, width) of positions first.. into sequence `seq`'s cells."""
        step = self._model.n_batch
        for at in range(0, len(rows), step):
            chunk = np.ascontiguousarray(rows[at : at + step], dtype=np.float32)
            llama_cpp.llama_batch_ext_clear(self._batch)
            for i in range(len(chunk)):
                idx = llama_cpp.llama_batch_ext_add_embd(self._batch, seq, llama_cpp.llama_embd(
                    chunk[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.width))
                if idx < 0:
                    raise DecodeError(f"{self._model.path.name}: llama.cpp refused a feature row ({idx})")
                self._pos.value = first + at + i
                llama_cpp.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos))
            self._process(f"the features of positions {first + at}..{first + at + len(chunk) - 1}")

    def blocks(self, items: Sequence[tuple[int, int, int]]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """One block per (seq, cur, pos0): `[cur, MASK ...]` at positions pos0.., several sequences' blocks a decode
        (all of one size: DSpark's Markov head needs that); each block's drafting rows (max_drafts, n_vocab) and,
        with a confidence head, its confidence per row. The blocks' cells go again."""
        per_call = max(1, self._model.n_batch // self.block)
        rows: list[np.ndarray] = []
        conf: list[np.ndarray] | None = [] if self.facts.confidence else None
        for at in range(0, len(items), per_call):
            group = items[at : at + per_call]
            llama_cpp.llama_batch_ext_clear(self._batch)
            for seq, cur, pos0 in group:
                for i in range(self.block):
                    token = cur if i == 0 else self.facts.mask_token
                    idx = llama_cpp.llama_batch_ext_add_token(self._batch, seq, token)
                    self._pos.value = pos0 + i
                    llama_cpp.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos))
                    llama_cpp.llama_batch_ext_set_output_logits(self._batch, idx, True)
            self._process("a block")
            for g in range(len(group)):
                first = g * self.block + self.offset
                rows.append(np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, first + r),
                                                            shape=(self._n_vocab,)).copy()
                                      for r in range(self.facts.max_drafts)]))
            if conf is not None:
                base = llama_cpp_ext.llama_get_embeddings_nextn(self._ctx)
                if not base:
                    raise DecodeError(f"{self._model.path.name}: llama.cpp returned no confidence rows")
                table = np.ctypeslib.as_array(base, shape=(len(group) * self.block, self._n_embd))
                for g in range(len(group)):
                    first = g * self.block + self.offset
                    conf.append(table[first : first + self.facts.max_drafts, 0].copy())
            for seq, _, pos0 in group:
                self._model.truncate(pos0, seq)
        return rows, conf

    def _process(self, what: str) -> None:
        rc = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise DecodeError(f"{self._model.path.name}: the drafter's decode of {what} failed with code {rc}"
                              + (" (no KV slot: the context is full)" if rc == 1 else ""))

    def close(self) -> None:
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None


# -- the pair, from headers alone -------------------------------------------------------------------------------

# Target architectures whose graph builder records every layer's input (`res->t_layer_inp[il] = inpL` in
# src/models/<arch>.cpp of the pinned llama.cpp). Another target aborts the process at its first decode with layer
# features on (llm_graph_result::set_outputs: "layer input tensor is null").
LAYER_INPUT_ARCHS = frozenset({"llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "gemma4"})
BLOCK_DRAFTER_ARCHS = frozenset({"dflash"})
EAGLE3_ARCH = "eagle3"
# Drafter GGUFs that read the target's layers and borrow its embeddings and output head (llama.cpp's ctx_other): the
# draft model is loaded over the target, and no other drafter can step it token by token.
FEATURE_DRAFTER_ARCHS = BLOCK_DRAFTER_ARCHS | {EAGLE3_ARCH}


@dataclass(frozen=True)
class BlockDrafterFacts:
    """What a block drafter's header says (what `localspec check` reports)."""

    kind: str  # "dflash" or "dspark"
    layers: tuple[int, ...]  # the target layers whose inputs it reads
    block_size: int
    max_drafts: int  # the most tokens one block proposes
    confidence: bool  # DSpark's confidence head (it chooses the length per round)
    mask_token: int
    own_head: bool  # it carries token_embd and output (else it reads the target's through ctx_other)
    # The block's first row (the anchor, cur) predicts the first draft (DSpark's sample_from_anchor): the block is
    # [cur, MASK x (n - 1)] for n drafts; else row i predicts position i, and it is [cur, MASK x n].
    from_anchor: bool = False
    causal: bool = False  # dflash.attention.causal: the block attends causally (llama.cpp's default: both ways)

    @property
    def title(self) -> str:
        name = "DSpark" + (" with a confidence head" if self.confidence else "") if self.kind == "dspark" else "DFlash"
        return f"{name}, block {self.block_size}, reads target layers {', '.join(map(str, self.layers))}"


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _same_vocabulary(target: GGUFHeader, draft: GGUFHeader) -> None:
    if draft.n_vocab != target.n_vocab:
        raise UsageError(f"{draft.name}: tokenizer.ggml.tokens holds {draft.n_vocab} tokens, {target.name} "
                         f"{target.n_vocab}: a drafter for another vocabulary")


def _layers_for(target: GGUFHeader, draft: GGUFHeader) -> list | None:
    """The drafter's `target_layers` array (None: missing or not an array), once the target's family is one whose
    graph gives its layer inputs (else the UsageError line naming the drafter file)."""
    if target.arch not in LAYER_INPUT_ARCHS:
        raise UsageError(f"{draft.name}: drafts for a target whose llama.cpp graph gives its layer inputs "
                         f"({', '.join(sorted(LAYER_INPUT_ARCHS))}); {target.name} is {target.arch!r} "
                         "(general.architecture)")
    raw = draft.arch_get("target_layers")
    return list(raw) if isinstance(raw, (list, tuple, np.ndarray)) else None


def check_block_drafter(target: GGUFHeader, draft: GGUFHeader, *, verify_width: int | None = None) -> BlockDrafterFacts:
    """The facts of a DFlash / DSpark drafter for this target, or one UsageError line naming the file and key that
    rule the pair out, before either model loads. `verify_width`: the most tokens the target takes in one decode
    (its n_batch); a block whose verify exceeds it is refused."""
    d = draft.name
    if draft.arch not in BLOCK_DRAFTER_ARCHS:
        raise UsageError(f"{d}: general.architecture is {draft.arch!r}, not a block drafter (dflash)")
    if draft.arch_get("hyper_connection.count", 0):
        raise UsageError(f"{d}: dflash.hyper_connection.count: a DeepSeek-V4 DSpark backbone, not supported")
    tensors = {t.name for t in draft.tensors}
    if "selector_hidden.weight" in tensors:
        raise UsageError(f"{d}: selector_hidden.weight: a DFlash2 drafter (selector lattice), not supported")
    layers = _layers_for(target, draft)
    if not layers or not all(_is_int(i) for i in layers):
        raise UsageError(f"{d}: dflash.target_layers is missing or not an array of layer numbers")
    n_layer = target.trunk_layers
    outside = [int(i) for i in layers if not 0 <= int(i) < n_layer]
    if outside:
        raise UsageError(f"{d}: dflash.target_layers {[int(i) for i in layers]} names layer "
                         f"{outside[0]}; {target.name} has layers 0..{n_layer - 1} ({target.arch}.block_count)")
    n_embd, t_embd = draft.hparams.n_embd, target.hparams.n_embd
    if n_embd != t_embd:
        raise UsageError(f"{d}: dflash.embedding_length {n_embd} is not the target's feature width {t_embd} "
                         f"({target.name}, {target.arch}.embedding_length)")
    hidden = draft.arch_get("target_hidden_size")
    if _is_int(hidden) and hidden != t_embd:
        raise UsageError(f"{d}: dflash.target_hidden_size {hidden} is not {target.name}'s "
                         f"{target.arch}.embedding_length {t_embd}")
    _same_vocabulary(target, draft)
    mask = draft.get("tokenizer.ggml.mask_token_id")
    if not _is_int(mask) or not 0 <= mask < draft.n_vocab:
        raise UsageError(f"{d}: tokenizer.ggml.mask_token_id is missing or outside the vocabulary (a block "
                         "drafter fills its block with it)")
    block = draft.arch_get("block_size")
    if not _is_int(block) or block < 2:
        raise UsageError(f"{d}: dflash.block_size is {block!r}; a block drafter needs 2 or more")
    dspark = "markov_w1.weight" in tensors
    anchor = draft.arch_get("sample_from_anchor", True)
    max_drafts = int(block) if dspark and anchor is not False else int(block) - 1
    if verify_width is not None and 1 + max_drafts > verify_width:
        raise UsageError(f"{d}: dflash.block_size {block} drafts {max_drafts} tokens a block, and {target.name} "
                         f"verifies at most {verify_width - 1} in one decode (n_batch {verify_width})")
    if 1 + max_drafts > target.hparams.n_ctx_train:
        raise UsageError(f"{d}: dflash.block_size {block} exceeds {target.name}'s context "
                         f"({target.arch}.context_length {target.hparams.n_ctx_train})")
    own_head = "token_embd.weight" in tensors  # (output falls back to it: llama-context.cpp needs ctx_other without)
    has_conf = dspark and "conf_proj.weight" in tensors and draft.arch_get("has_confidence_head", True) is not False
    return BlockDrafterFacts("dspark" if dspark else "dflash", tuple(int(i) for i in layers), int(block),
                             max_drafts, has_conf, int(mask), own_head, from_anchor=dspark and anchor is not False,
                             causal=bool(draft.arch_get("attention.causal", False)))


@dataclass(frozen=True)
class Eagle3Facts:
    """What an EAGLE-3 drafter's header says (what `localspec check` reports)."""

    layers: tuple[int, int, int]  # the target layers whose inputs its encoder fuses
    draft_vocab: int | None  # its reduced vocabulary (d2t), None: the target's

    @property
    def title(self) -> str:
        vocab = f", a draft vocabulary of {self.draft_vocab}" if self.draft_vocab else ""
        return f"EAGLE-3, reads target layers {', '.join(map(str, self.layers))}{vocab}"


def check_eagle3_drafter(target: GGUFHeader, draft: GGUFHeader) -> Eagle3Facts:
    """The facts of an EAGLE-3 drafter for this target, or one UsageError line naming the file and key that rule
    the pair out, before either model loads (llama.cpp aborts the process on some of them)."""
    d = draft.name
    if draft.arch != EAGLE3_ARCH:
        raise UsageError(f"{d}: general.architecture is {draft.arch!r}, not an EAGLE-3 drafter (eagle3)")
    layers = _layers_for(target, draft)
    if not layers or len(layers) != 3 or not all(_is_int(i) for i in layers):
        shown = [int(i) if _is_int(i) else i for i in layers] if layers else draft.arch_get("target_layers")
        raise UsageError(f"{d}: eagle3.target_layers must be three layer numbers, not {shown!r}")
    n_layer = target.trunk_layers
    if n_layer in layers:  # (llama.cpp reads the target's NextN rows there, beside two layers' inputs)
        raise UsageError(f"{d}: eagle3.target_layers {[int(i) for i in layers]} names {n_layer}, the target's "
                         "final hidden state: not supported (layer inputs only)")
    outside = [int(i) for i in layers if not 0 <= int(i) < n_layer]
    if outside:
        raise UsageError(f"{d}: eagle3.target_layers {[int(i) for i in layers]} names layer {outside[0]}; "
                         f"{target.name} has layers 0..{n_layer - 1} ({target.arch}.block_count)")
    t_embd = target.hparams.n_embd
    hidden = draft.arch_get("target_hidden_size")
    if hidden != t_embd:
        raise UsageError(f"{d}: eagle3.target_hidden_size {hidden!r} is not {target.name}'s "
                         f"{target.arch}.embedding_length {t_embd}")
    tensors = {t.name: t for t in draft.tensors}
    if "token_embd.weight" not in tensors and draft.hparams.n_embd != t_embd:
        raise UsageError(f"{d}: eagle3.embedding_length {draft.hparams.n_embd} is not {target.name}'s "
                         f"{t_embd}, whose token embeddings it reads (it has no token_embd.weight)")
    _same_vocabulary(target, draft)
    d2t = tensors.get("d2t")
    return Eagle3Facts((int(layers[0]), int(layers[1]), int(layers[2])), None if d2t is None else int(d2t.shape[0]))
