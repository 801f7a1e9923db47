"""Slot state files without a model: every check a file meets before llama.cpp sees it (identity, versions, slot
count, size, checksum, token ids), atomic writes, and file names that cannot leave the save folder."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from localspec.rounds import slot_file
from localspec.rounds.prompt_cache import ModelState, SeqFile, SlotState
from localspec.rounds.slot_file import ModelIdentity, SlotFileError, check_name, fingerprint, path_in, save_path_in
from tests.conftest import temp_files
from tests.helpers_gguf import STRING, kv, pack

TARGET = ModelIdentity("target.gguf", "a" * 64, "f16", 1)
DRAFT = ModelIdentity("draft.gguf", "b" * 64, "f16", 1)


def a_state(n: int = 6, draft: int | None = 5) -> SlotState:
    models = [ModelState(n, bytearray(os.urandom(300)), 0)]
    if draft is not None:
        models.append(ModelState(draft, bytearray(os.urandom(120)), 0))
    return SlotState(tuple(range(10, 10 + n)), tuple(models))


def read(path: Path, models=(TARGET, DRAFT), n_vocab: int = 1000, n_ctx: int = 64) -> slot_file.Loaded:
    return slot_file.read(path, list(models), n_vocab=n_vocab, n_ctx=n_ctx)


def test_round_trip(tmp_path: Path) -> None:
    state = a_state()
    path = tmp_path / "s.slot"
    written = slot_file.write(path, state, [TARGET, DRAFT], {"note": "x"})
    assert written == path.stat().st_size
    loaded = read(path)
    assert loaded.state.tokens == state.tokens and loaded.extra == {"note": "x"} and loaded.nbytes == written
    for got, want in zip(loaded.state.models, state.models, strict=True):
        assert (got.n_tokens, got.floor, got.data) == (want.n_tokens, want.floor, want.data)


def test_draft_parts_may_be_missing_on_either_side(tmp_path: Path) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    alone = read(path, models=[TARGET])  # a server without the draft restores the target only
    assert len(alone.state.models) == 1
    slot_file.write(path, a_state(draft=None), [TARGET])
    both = read(path)  # the draft's cells start empty, to be decoded
    assert both.state.models[1].n_tokens == 0 and not both.state.models[1].data


@pytest.mark.parametrize(("change", "message"), [
    (lambda: [dataclasses.replace(TARGET, fingerprint="c" * 64), DRAFT], "saved with the target target.gguf"),
    (lambda: [TARGET, dataclasses.replace(DRAFT, fingerprint="c" * 64)], "saved with the draft draft.gguf"),
    (lambda: [dataclasses.replace(TARGET, kv_type="q8_0"), DRAFT], "KV type f16; the target here uses q8_0"),
    (lambda: [dataclasses.replace(TARGET, n_seq=4), DRAFT], "saved from 1 slot.*--parallel 1"),
])
def test_another_model_kv_type_or_slot_count_is_refused(tmp_path: Path, change, message: str) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    with pytest.raises(SlotFileError, match=message):
        read(path, models=change())


def rewrite_header(path: Path, edit, seal: bool = False) -> None:
    """A slot file's header JSON changed by `edit`; with `seal`, its checksum made right again (a consistent file
    whose content disagrees, for the checks that come after the checksum's)."""
    raw = path.read_bytes()
    fixed = len(slot_file.MAGIC) + 8
    (length,) = struct.unpack_from("<I", raw, len(slot_file.MAGIC) + 4)
    header = json.loads(raw[fixed : fixed + length])
    edit(header)
    head = json.dumps(header).encode()
    body = raw[: len(slot_file.MAGIC) + 4] + struct.pack("<I", len(head)) + head + raw[fixed + length :]
    path.write_bytes(body[:-32] + hashlib.sha256(body[:-32]).digest() if seal else body)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda h: h.update(localspec="0.0.1"), "saved by localspec '0.0.1'"),
    (lambda h: h.update(llama_cpp_python="0.2.0"), "saved with llama-cpp-python '0.2.0'"),
    (lambda h: h.update(tokens=7), "bytes where its header says"),
    (lambda h: h["models"][0].update(bytes="x"), "not a count"),
    (lambda h: h["models"][0].update(n_tokens=99), "holds 99 of 6 tokens"),
    (lambda h: h.update(models=[]), "names no models"),
])
def test_a_header_that_disagrees_is_refused(tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    rewrite_header(path, edit)
    with pytest.raises(SlotFileError, match=message):
        read(path)


def test_corruption_anywhere_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    raw = path.read_bytes()
    for at in (len(raw) // 2, len(raw) - 40, len(raw) - 1):  # a state byte, a token or state byte, the checksum
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(SlotFileError, match="checksum mismatch|outside the vocabulary"):
            read(path)
    path.write_bytes(raw[:-10])
    with pytest.raises(SlotFileError, match="cut short"):
        read(path)
    path.write_bytes(b"GGUF" + raw[4:])
    with pytest.raises(SlotFileError, match="not a localspec slot file"):
        read(path)
    path.write_bytes(raw[: len(slot_file.MAGIC)] + struct.pack("<I", 3) + raw[len(slot_file.MAGIC) + 4 :])
    with pytest.raises(SlotFileError, match="format 3; this localspec reads formats 1, 2"):
        read(path)


class Part:
    """A drafter's part as SlotState.drafters holds one (the file form is all a slot file sees of it)."""

    def __init__(self, kind: str, meta: dict, blobs: tuple[bytes, ...]) -> None:
        self.file = SeqFile(kind, meta, tuple(bytearray(b) for b in blobs))

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.file.blobs)

    def to_file(self) -> SeqFile:
        return self.file


def test_drafters_parts_round_trip_and_are_checked_like_the_rest(tmp_path: Path) -> None:
    """A drafter's part (an MTP head's cells and rows) is written after the models' states and read back as it was;
    a state without one (None) writes none; the header's part entries and sizes are checked like the models'."""
    path = tmp_path / "s.slot"
    part = Part("mtp", {"tokens": 3, "anchor": None}, (os.urandom(50), b"", os.urandom(12)))
    state = dataclasses.replace(a_state(), drafters=(None, part))
    written = slot_file.write(path, state, [TARGET, DRAFT])
    loaded = read(path)
    assert loaded.parts == (part.file,) and loaded.nbytes == written
    assert [m.data for m in loaded.state.models] == [m.data for m in state.models]
    for edit, message in ((lambda h: h["drafters"][0].update(bytes=[50, 0, 13]), "bytes where its header says"),
                          (lambda h: h["drafters"][0].update(kind=7), "drafter part 0 of the header is malformed"),
                          (lambda h: h["drafters"][0].update(bytes=[-1, 0, 12]), "not a count"),
                          (lambda h: h.update(drafters={}), "drafters is not a list")):
        slot_file.write(path, state, [TARGET, DRAFT])
        rewrite_header(path, edit)
        with pytest.raises(SlotFileError, match=message):
            read(path)


def test_a_format_1_file_is_read_without_drafters_parts(tmp_path: Path) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    raw = bytearray(path.read_bytes())
    raw[len(slot_file.MAGIC) : len(slot_file.MAGIC) + 4] = struct.pack("<I", 1)
    path.write_bytes(bytes(raw))
    rewrite_header(path, lambda h: (h.pop("drafters"), h.update(format=1)), seal=True)
    loaded = read(path)
    assert loaded.parts == () and loaded.state.tokens == a_state().tokens


def test_token_ids_and_length_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    with pytest.raises(SlotFileError, match="token id 15 is outside the vocabulary"):
        read(path, n_vocab=15)
    with pytest.raises(SlotFileError, match="holds 6 tokens; the context holds 5"):
        read(path, n_ctx=5)


def test_what_is_not_a_slot_file(tmp_path: Path) -> None:
    with pytest.raises(SlotFileError, match="no such slot file"):
        read(tmp_path / "missing")
    with pytest.raises(SlotFileError, match="is a directory"):
        read(tmp_path)
    target = tmp_path / "real"
    slot_file.write(target, a_state(), [TARGET, DRAFT])
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(SlotFileError, match="symbolic link"):
        read(link)
    with pytest.raises(SlotFileError, match="symbolic link"):
        path_in(tmp_path, "link")


def test_a_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.slot"
    slot_file.write(path, a_state(), [TARGET, DRAFT])
    before = path.read_bytes()

    class Boom(Exception):
        pass

    real = slot_file._Hashing.write
    calls = []

    def fail_at_the_state(self, data) -> None:  # the write fails halfway: header and tokens went out
        calls.append(len(data))
        if len(calls) > 4:
            raise Boom
        real(self, data)

    monkeypatch.setattr(slot_file._Hashing, "write", fail_at_the_state)
    with pytest.raises(Boom):
        slot_file.write(path, a_state(), [TARGET, DRAFT])
    assert path.read_bytes() == before and not temp_files(tmp_path)


@pytest.mark.parametrize("name", ["../x", "a/b", "a\\b", "..", ".", "", " lead", "trail ", "dot.", "x" * 256,
                                  "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", "a\x00b", "a\nb", "a\x7fb",
                                  "a\u2215b", "a\u2216b", "a\uff0eb", "a\ufeffb", "..hidden", "/etc/passwd"])
def test_names_that_could_leave_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SlotFileError):
        check_name(name)
    with pytest.raises(SlotFileError):
        path_in(tmp_path, name)


@pytest.mark.parametrize("name", [".hidden", ".bashrc", ".localspec-probe", ".x.123.tmp", "chat 1.slot",
                                  "naïve-été.bin", "-rf", "_x", "slot\u00b2.bin", "a\u00a0b", "x\u0301.bin"])
def test_names_outside_the_safe_set_are_refused(tmp_path: Path, name: str) -> None:
    """Before: a save could replace any file of the folder but its symlinks: a dotfile (the folder's own, or an
    atomic write's temporary file), a name with spaces or any Unicode."""
    with pytest.raises(SlotFileError, match="letters, digits"):
        check_name(name)


@pytest.mark.parametrize("name", ["slot0.bin", "a.b.c", "Chat_1-2.slot", "x", "9"])
def test_ordinary_names_are_kept_as_given(tmp_path: Path, name: str) -> None:
    assert check_name(name) == name
    assert path_in(tmp_path, name) == tmp_path / name


def test_a_save_replaces_a_slot_file_and_nothing_else(tmp_path: Path) -> None:
    """Before: a save replaced whatever file had the name it was given (notes, a config kept in that folder)."""
    assert save_path_in(tmp_path, "new.bin") == tmp_path / "new.bin"  # nothing there yet
    slot_file.write(tmp_path / "old.bin", a_state(), [TARGET, DRAFT])
    assert save_path_in(tmp_path, "old.bin") == tmp_path / "old.bin"
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe")
    for name, why in (("notes.txt", "not a slot file has this name"), ("empty.bin", "not a slot file has this name"),
                      ("folder", "is a directory"), ("pipe", "is a FIFO")):
        with pytest.raises(SlotFileError, match=why):
            save_path_in(tmp_path, name)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _gguf(path: Path, name: str, data: bytes) -> Path:
    path.write_bytes(pack([kv("general.architecture", STRING, "llama"), kv("general.name", STRING, name)],
                          data=data))
    return path


def test_fingerprint_tells_models_apart_and_is_stable(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    a = _gguf(tmp_path / "a.gguf", "m", data)
    b = _gguf(tmp_path / "b.gguf", "m", data)
    assert fingerprint(a) == fingerprint(b)  # the same bytes under another name: the same model
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1  # a weight in the middle of the file (a sampled region) differs
    c = _gguf(tmp_path / "c.gguf", "m", bytes(changed))
    assert fingerprint(c) != fingerprint(a)
    d = _gguf(tmp_path / "d.gguf", "other", data)  # metadata differs
    assert fingerprint(d) != fingerprint(a)
