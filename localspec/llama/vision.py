"""Images: a multimodal projector (an mmproj GGUF) loaded beside the target through llama.cpp's libmtmd, pictures
checked and decoded before llama.cpp sees them, and a prompt's text and pictures as one list of token ids.

A picture's positions in a prompt are placeholder ids, negative numbers no vocabulary holds: each is drawn from the
picture's digest and its index within the picture (31 bits each), so two prompts that share a picture share its
ids (a slot's cells, the prompt cache and llama-server's `cache_prompt` reuse them as any prefix), and a prefix that
shares a picture's first ids but not its pixels cannot be mistaken for it. The target decodes a picture's ids as the
picture (`Projector.decode`: libmtmd's encoder, then its embeddings at those positions, n_batch at a time, in one
batch where the projector wants non-causal attention); a model without the projector (a draft model) reads a filler
token in their place: what a drafter sees never changes what the target accepts, so speculation stays exact, it only
drafts without the picture. A prefix reused from a slot never ends inside a picture (`prompt_cache.shared_prefix`).

Pictures are decoded by Pillow, not by libmtmd's own loader: its stb_image decodes whatever it is handed, at any
size, and a buffer it cannot decode goes to an ffmpeg subprocess where one is installed (mtmd-helper's video path).
Here the file's size, the format (PNG, JPEG, GIF, BMP, WebP), the pixel count and each side are checked from the
header before any pixel is decoded, and a truncated file is an error, not a grey picture.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import struct
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gguf import GGUFValueType

from localspec.config import ImageSettings
from localspec.errors import DecodeError, ModelLoadError, UsageError
from localspec.models.gguf_header import read_header

FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")  # what Pillow may open: stills only, no exotic decoders
PLACEHOLDER_BITS = 31  # a placeholder id is -(1 + a 31-bit number): an int32, as every token list holds


class Target(Protocol):
    """What a projector needs of its target (a `LlamaModel`; named here so that model.py may import this module)."""

    path: Path
    model: Any
    ctx: Any
    n_batch: int
    on_gpu: bool


class ImageError(UsageError):
    """A picture that cannot be used: one line naming it (a file, a request's content part)."""


@dataclass(frozen=True)
class Picture:
    """A decoded picture: RGB pixels, row by row, and the digest its placeholder ids come from."""

    width: int
    height: int
    rgb: bytes
    digest: bytes

    @property
    def name(self) -> str:
        return self.digest.hex()[:16]


def decode_picture(data: bytes, name: str, limits: ImageSettings) -> Picture:
    """`data` (a file's bytes) as a Picture, or an ImageError naming `name` and what is wrong with it."""
    from PIL import Image, UnidentifiedImageError  # (only a run with pictures pays for the import)

    if len(data) > limits.max_image_bytes:
        raise ImageError(f"{name}: {len(data):,} bytes; a picture may have at most {limits.max_image_bytes:,} "
                         "([images] max_image_bytes)")
    if not data:
        raise ImageError(f"{name}: empty: not a picture")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns at half its limit and raises above it; ours below is the one that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not a picture localspec reads ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:  # (Pillow's own limit, far above ours: its header declares too many)
        raise ImageError(f"{name}: declares too many pixels; at most {limits.max_image_side} a side and "
                         f"{limits.max_image_pixels:,} in all ([images] max_image_side, max_image_pixels)") from None
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        raise ImageError(f"{name}: unreadable picture ({exc})") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError(f"{name}: a picture of {width} x {height} pixels")
        if max(width, height) > limits.max_image_side or width * height > limits.max_image_pixels:
            raise ImageError(f"{name}: {width} x {height} pixels; at most {limits.max_image_side} a side and "
                             f"{limits.max_image_pixels:,} in all ([images] max_image_side, max_image_pixels)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image.seek(0)  # an animation's first frame
                rgb = image.convert("RGB").tobytes()
        except (OSError, ValueError, SyntaxError, struct.error, EOFError, Image.DecompressionBombError) as exc:
            raise ImageError(f"{name}: truncated or corrupt picture ({exc})") from None
    digest = hashlib.sha256(struct.pack("<II", width, height) + rgb).digest()
    return Picture(width, height, rgb, digest)


def data_uri_bytes(uri: str, name: str) -> bytes:
    """The bytes of a data:image/...;base64 URI (a request's image_url part), or an ImageError naming `name`."""
    import base64
    import binascii

    _, sep, payload = uri.partition(";base64,")
    if not sep:
        raise ImageError(f"{name}: not a data:image/<type>;base64 URI")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name}: its base64 data does not decode") from None


def read_picture(path: Path, limits: ImageSettings) -> Picture:
    """A picture file (`--image`, chat's `/image`), checked as `decode_picture` checks bytes."""
    try:
        size = path.stat().st_size
        if size > limits.max_image_bytes:  # (not read into memory first)
            raise ImageError(f"{path}: {size:,} bytes; a picture may have at most {limits.max_image_bytes:,} "
                             "([images] max_image_bytes)")
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"{path}: {exc.strerror or exc}") from None
    return decode_picture(data, str(path), limits)


MARKER = "<__media__>"  # libmtmd's default marker (mtmd_default_marker): where a picture goes in a prompt's text


def with_markers(text: str, n: int) -> str:
    """`text` with a marker for each of n pictures: as it is where it holds them, else one per picture before it
    (as llama.cpp's mtmd-cli does)."""
    return text if MARKER in text else "".join(MARKER + "\n" for _ in range(n)) + text


def placeholder_ids(digest: bytes, n: int) -> list[int]:
    """The n placeholder ids of a picture's positions: -(1 + 31 bits of sha256(digest, index))."""
    mask = (1 << PLACEHOLDER_BITS) - 1
    return [-(1 + (int.from_bytes(hashlib.sha256(digest + i.to_bytes(4, "little")).digest()[:4], "little")
                   & mask)) for i in range(n)]


def holds_pictures(tokens: Sequence[int]) -> bool:
    return any(t < 0 for t in tokens)


def text_prefix(tokens: list[int]) -> list[int]:
    """`tokens` up to the first placeholder: a drafter that copies from the context never proposes a picture."""
    for i, token in enumerate(tokens):
        if token < 0:
            return tokens[:i]
    return tokens


def runs(tokens: Sequence[int]) -> list[tuple[bool, int, int]]:
    """(is a picture's, start, end) of each run of text ids or of placeholder ids, in order."""
    out: list[tuple[bool, int, int]] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or (tokens[i] < 0) != (tokens[start] < 0):
            out.append((tokens[start] < 0, start, i))
            start = i
    return out


def check_projector_file(path: Path) -> None:
    """A missing file, or one that is no projector, stops with one line naming it (libmtmd would log and return
    NULL, or abort on a malformed header); the header is read bounded, no weights."""
    if not Path(path).is_file():
        raise ModelLoadError(f"{path}: projector file not found")
    header = read_header(Path(path))
    if header.arch != "clip":
        raise ModelLoadError(f"{path}: not a projector (general.architecture is {header.arch!r}, a projector's is "
                             "'clip')")
    # clip.cpp reads its numbers with gguf_get_val_u32/_f32/_bool, which abort the process (GGML_ASSERT) on a key
    # of another type: such a key stops here (docs/upstream.md).
    wanted = {int: (GGUFValueType.UINT32, "uint32"), float: (GGUFValueType.FLOAT32, "float32"),
              bool: (GGUFValueType.BOOL, "bool")}
    for key, value in header.metadata.items():
        kind = wanted.get(type(value))
        if key.startswith("clip.") and kind is not None and header.value_types.get(key) != kind[0]:
            raise ModelLoadError(f"{path}: {key} is stored as {GGUFValueType(header.value_types[key]).name.lower()}; "
                                 f"llama.cpp's projector loader needs {kind[1]} (a malformed projector)")
    _mtmd()


def check_projector_tensors(path: Path, on_gpu: bool) -> None:
    """Tensors llama.cpp's CPU backend would abort on while encoding a picture: position embeddings in another type
    than F32 (its add of F32 patches and F16 positions is unsupported there: docs/upstream.md)."""
    if on_gpu:
        return
    found = next((t for t in read_header(Path(path)).tensors if t.name == "v.position_embd.weight"), None)
    if found is not None and found.type_id != 0:
        raise ModelLoadError(f"{path}: v.position_embd.weight is {found.type_name}; on the CPU llama.cpp encodes "
                             "pictures only with F32 position embeddings (it would abort)")


_logging_routed = False


def _mtmd():  # noqa: ANN202 (the bindings module)
    """llama-cpp-python's libmtmd bindings, or a ModelLoadError saying the build has none; libmtmd's log (and
    clip's) goes where llama.cpp's does (stderr with LOCALSPEC_DEBUG=1 only)."""
    global _logging_routed
    try:
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError, FileNotFoundError) as exc:
        raise ModelLoadError(
            "this llama-cpp-python was built without libmtmd (images): reinstall it with -DLLAVA_BUILD=ON in "
            f"CMAKE_ARGS (README) ({exc})") from None
    if not _logging_routed:
        from localspec.llama import backend

        backend.init()
        mtmd_cpp.mtmd_helper_log_set(backend.log_callback(), ctypes.c_void_p(0))
        _logging_routed = True
    return mtmd_cpp


class PictureChunk:
    """One picture's libmtmd chunk (a copy this object owns, freed with it), its token count and the positions it
    takes (fewer with M-RoPE). A prompt holds its pictures' chunks (`PromptTokens`), so a picture stays decodable
    exactly as long as a prompt that needs it lives (a queued request's, a chat turn's), however many pictures
    arrive meanwhile."""

    def __init__(self, m: Any, ptr: ctypes.c_void_p, n_tokens: int, n_pos: int) -> None:
        self._m, self.ptr, self.n_tokens, self.n_pos = m, ptr, n_tokens, n_pos

    def __del__(self) -> None:
        if self.ptr:
            self._m.mtmd_input_chunk_free(self.ptr)
            self.ptr = None


class PromptTokens(list):  # type: ignore[type-arg]
    """Token ids that hold pictures' placeholder ids, and those pictures' chunks (kept alive with the list)."""

    pictures: tuple[PictureChunk, ...] = ()


def holding(tokens: list[int], *sources: Sequence[int]) -> list[int]:
    """`tokens` (built from `sources`: a prompt's pieces) as a list that keeps the sources' pictures alive."""
    held = tuple(c for src in sources for c in getattr(src, "pictures", ()))
    if not held:
        return tokens
    out = PromptTokens(tokens)
    out.pictures = held
    return out


class Projector:
    """An mmproj GGUF loaded for one target (libmtmd's context), its pictures' chunks by their first placeholder id.

    `tokenize` turns a prompt's text (with one `marker` per picture) and its pictures into token ids, pictures as
    placeholder ids; the returned list holds their chunks (`PromptTokens`), which `decode` finds by a picture's first
    id while any prompt holding them lives (a registry of weak references: nothing here keeps a picture alive)."""

    def __init__(self, path: Path, target: Target, n_threads: int, max_tokens: int = 0) -> None:
        self.path = Path(path)
        check_projector_file(self.path)
        check_projector_tensors(self.path, target.on_gpu)
        m = _mtmd()
        self._m = m
        self.target = target
        params = m.mtmd_context_params_default()
        params.use_gpu = target.on_gpu
        params.n_threads = n_threads
        params.print_timings = False
        # Warm-up on, as llama-server loads it: libmtmd reserves the vision tower's compute buffer now (a projector
        # that cannot fit fails at load, not at a client's first picture) and turns flash attention on where the
        # backend runs it for the tower; off, it never tries flash attention, and a Qwen-VL picture of 4096 tokens
        # keeps 16 GiB of attention scores (docs/images.md).
        params.warmup = True
        if max_tokens > 0:  # ([images] max_image_tokens; 0: the projector's own limit)
            params.image_max_tokens = max_tokens
        self.ctx = m.mtmd_init_from_file(str(self.path).encode(), target.model, params)
        if not self.ctx:
            raise ModelLoadError(f"{self.path}: libmtmd could not load this projector for {target.path.name} "
                                 "(its width must be the target's embedding width; LOCALSPEC_DEBUG=1 shows why)")
        if not m.mtmd_support_vision(self.ctx):
            self.close()
            raise ModelLoadError(f"{self.path}: this projector reads no pictures (audio only)")
        # With an M-RoPE text model (Qwen2/2.5/3-VL, Qwen3.5/3.6: libmtmd decides by the text model's rope type)
        # a picture takes fewer positions than tokens; the target's cells keep track (llama.places).
        self.mrope = bool(m.mtmd_decode_use_mrope(self.ctx))
        self.marker = m.mtmd_default_marker().decode()
        if self.marker != MARKER:
            self.close()
            raise ModelLoadError(f"libmtmd's picture marker is {self.marker!r}, not {MARKER!r}: another version")
        self._chunks: weakref.WeakValueDictionary[int, PictureChunk] = weakref.WeakValueDictionary()

    def tokenize(self, text: str, pictures: Sequence[Picture], *, add_special: bool,
                 parse_special: bool) -> list[int]:
        """The prompt's token ids: its text's, and each picture's placeholder ids where its marker stands (a list
        that holds the pictures' chunks: keep it, or a list made with `holding` from it, until it is decoded)."""
        m = self._m
        if text.count(self.marker) != len(pictures):
            raise ImageError(f"the prompt has {text.count(self.marker)} picture markers ({self.marker}) for "
                             f"{len(pictures)} pictures")
        bitmaps = []
        chunks = m.mtmd_input_chunks_init()
        try:
            for picture in pictures:
                buf = (ctypes.c_uint8 * len(picture.rgb)).from_buffer_copy(picture.rgb)
                bitmap = m.mtmd_bitmap_init(picture.width, picture.height, buf)
                if not bitmap:
                    raise ImageError(f"picture {picture.name}: libmtmd refused its pixels")
                m.mtmd_bitmap_set_id(bitmap, picture.digest.hex().encode())
                bitmaps.append(bitmap)
            entry = m.mtmd_input_text()
            encoded = text.encode()
            entry.text = encoded
            entry.text_len = len(encoded)
            entry.add_special = add_special
            entry.parse_special = parse_special
            array = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(entry), array, len(bitmaps))
            if rc != 0:
                raise ImageError(f"libmtmd could not read the prompt's pictures (mtmd_tokenize: {rc})")
            tokens = PromptTokens()
            held: list[PictureChunk] = []
            by_digest = {p.digest.hex(): p for p in pictures}
            for i in range(m.mtmd_input_chunks_size(chunks)):
                chunk = m.mtmd_input_chunks_get(chunks, i)
                kind = m.mtmd_input_chunk_get_type(chunk)
                if kind == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ids = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens += [int(ids[j]) for j in range(n.value)]
                    continue
                if kind != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    raise ImageError("the prompt holds a medium localspec does not read (audio)")
                n_tokens = int(m.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(m.mtmd_input_chunk_get_n_pos(chunk))
                if not 0 < n_pos <= n_tokens:
                    raise ImageError(f"a picture of {n_tokens} tokens at {n_pos} positions: not supported")
                # libmtmd decodes a picture's embeddings n_batch at a time; a projector whose picture attends to
                # itself both ways (Gemma 3's) needs it in one batch, or its first rows never see its last. A
                # causal one (Qwen-VL's, M-RoPE) reads as text does, in any split: a Qwen3.6 picture of 1024 x 768
                # pixels is 768 tokens, over the default n_batch of 512.
                if n_tokens > self.target.n_batch and m.mtmd_decode_use_non_causal(self.ctx, chunk):
                    raise ImageError(f"a picture of {n_tokens} tokens does not fit one batch of "
                                     f"{self.target.n_batch} ([load] n_batch), which this projector's pictures "
                                     "need (they attend to themselves both ways): raise it")
                picture = by_digest[m.mtmd_input_chunk_get_id(chunk).decode()]
                ids = placeholder_ids(picture.digest, n_tokens)
                kept = PictureChunk(m, m.mtmd_input_chunk_copy(chunk), n_tokens, n_pos)
                self._chunks[ids[0]] = kept
                held.append(kept)
                tokens += ids
            tokens.pictures = tuple(held)
            return tokens
        finally:
            m.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                m.mtmd_bitmap_free(bitmap)

    def picture_tokens(self, picture: Picture) -> list[int]:
        """One picture's tokens alone: its placeholder ids with the projector's own wrapping text around them
        (Gemma 3's `<start_of_image>`, as special tokens): what `tokenize` puts where its marker is."""
        return self.tokenize(MARKER, [picture], add_special=False, parse_special=True)

    def pictures_in(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """(start, length) of each picture in `tokens` (a run of placeholder ids may hold several)."""
        out = []
        for is_picture, start, end in runs(tokens):
            i = start
            while is_picture and i < end:
                found = self._chunks.get(tokens[i])
                if found is None:
                    raise ImageError("a picture's ids without its picture (no prompt holds it any more, or the ids "
                                     "were cut): send the picture again")
                out.append((i, found.n_tokens))
                i += found.n_tokens
        return out

    def decode(self, first: int, start_pos: int, seq: int) -> int:
        """The picture whose first placeholder id is `first`, encoded and decoded into the target's sequence `seq`
        at positions start_pos.. (n_batch at a time; one batch, non-causal attention, where the projector wants
        that: `tokenize` refuses a larger one); the positions it took (its tokens', or fewer with M-RoPE:
        llama.places)."""
        found = self._chunks.get(first)
        if found is None:
            raise ImageError("a picture's ids without its picture: send the picture again")
        n = found.n_tokens
        new_pos = ctypes.c_int(0)
        rc = self._m.mtmd_helper_eval_chunk_single(self.ctx, self.target.ctx, found.ptr, start_pos, seq,
                                                   self.target.n_batch, False, ctypes.byref(new_pos))
        if rc != 0:
            raise DecodeError(f"{self.path.name}: decoding a picture failed (mtmd_helper_eval_chunk_single: {rc})")
        if new_pos.value != start_pos + found.n_pos:
            raise DecodeError(f"{self.path.name}: a picture of {n} tokens at {found.n_pos} positions took "
                              f"positions {start_pos}..{new_pos.value}")
        return found.n_pos

    def close(self) -> None:
        if getattr(self, "ctx", None):  # (the chunks are libmtmd's plain copies: they outlive its context safely)
            self._m.mtmd_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        self.close()
