"""bench/projector_memory.py: clip.cpp's own compute-buffer figures, read from its log in a process of its own, with
flash attention asked on and off (the memory plan's check; its CPU run is in docs/images.md)."""

from __future__ import annotations

from pathlib import Path

import projector_memory  # bench/projector_memory.py (conftest puts bench/ on the path)
import pytest
from synthetic import TINY, TINY_HIGH, ProjectorSpec, write_projector

from localspec.models import memory
from localspec.models.gguf_header import read_header


def test_the_buffer_is_read_from_clips_log_with_flash_attention_on_and_off(tiny_pair_high, tmp_path: Path) -> None:
    path = write_projector(tmp_path / "mmproj.gguf", ProjectorSpec(n_embd_text=TINY_HIGH.n_embd, image_size=64))
    on, used_on, device = projector_memory.measure(tiny_pair_high[0], path, 1, gpu=False)
    off, used_off, _ = projector_memory.measure(tiny_pair_high[0], path, 0, gpu=False)
    assert (used_on, used_off, device) == (True, False, "CPU")
    # 16 x 16 patches, 2 heads: without flash attention the scores alone take half a MiB; with it, less is reserved
    scores = memory.projector_attention_bytes(read_header(path), 256) / 2**20
    assert 0 < on < off and off >= scores == pytest.approx(0.5)


def test_a_projector_it_cannot_load_is_one_line(tiny_pair_high, tmp_path: Path) -> None:
    wrong = write_projector(tmp_path / "wide.gguf", ProjectorSpec(n_embd_text=TINY_HIGH.n_embd + 8))
    with pytest.raises(SystemExit, match=r"^wide\.gguf \(flash_attn 1\): exit 3: "):
        projector_memory.measure(tiny_pair_high[0], wrong, 1, gpu=False)


def test_a_synthetic_text_model_takes_the_vocabularys_tokenizer(tiny_pair_high, tmp_path: Path, monkeypatch) -> None:
    """--synthetic-text (a machine without the demo pair): the projectors go beside a tiny text model written with
    that GGUF's tokenizer, whose width they project to."""
    seen = {}

    def measure_all(args, tmp: Path) -> list:
        header = read_header(args.text_model)
        seen.update(n_vocab=header.n_vocab, width=header.hparams.n_embd, exists=args.text_model.is_file())
        return []

    monkeypatch.setattr(projector_memory, "measure_all", measure_all)
    monkeypatch.setattr(projector_memory, "write_csv", lambda args, rows: None)
    monkeypatch.setattr("sys.argv", ["projector_memory.py", "--out", str(tmp_path / "m.csv"), "--synthetic-text",
                                     str(tiny_pair_high[0])])
    projector_memory.main()
    assert seen == {"n_vocab": read_header(tiny_pair_high[0]).n_vocab, "width": TINY.n_embd, "exists": True}
