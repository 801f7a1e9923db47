"""What a projector's compute buffer measures against the memory plan's price for it (`doctor --mmproj`).

libmtmd reserves the vision tower's compute buffer when it loads a projector with warm-up on (what localspec and
llama-server do): a graph for its warm-up picture (Gemma 3: its one picture size; a Qwen-VL merger: 46 x 46 merged
tokens; a larger picture grows the buffer later), with flash attention where the backend runs it for the tower's
head width. This script writes projectors at real dimensions (random weights, F16 like published mmproj files),
loads each beside a text model in a process of its own with flash attention on and then off, and reads clip.cpp's
own log line ("compute buffer size = ... MiB") and its verdict ("flash attention is enabled"). Beside each, the
plan's formula (`localspec.models.memory.projector_attention_bytes` and `projector_activation_bytes`) at the same
picture.

    python bench/projector_memory.py --out bench/results/DATE-cpu-projector-memory.csv [--gpu]
        [--text-model GGUF | --synthetic-text VOCAB.gguf]

The CSV's rows: projector, flash_attn (asked), flash_attn_used (clip's log), patches, buffer_mib (measured),
plan_mib (the formula for that flash attention), attention_mib and activations_mib (the formula's two terms),
device. `--gpu`: the buffers on the first GPU (a CUDA build of llama-cpp-python), else the CPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from synthetic import TINY, gemma3_projector, qwen_vl_projector, write_pair, write_projector  # noqa: E402

from localspec.models import memory  # noqa: E402
from localspec.models.gguf_header import read_header  # noqa: E402

MIB = 2**20
COLUMNS = ("projector", "flash_attn", "flash_attn_used", "patches", "buffer_mib", "plan_mib", "attention_mib",
           "activations_mib", "device")

# The child: libmtmd's log to stderr, one projector loaded with warm-up on and the asked flash attention.
CHILD = r"""
import ctypes, sys
import llama_cpp
from llama_cpp import mtmd_cpp as m

@llama_cpp.llama_log_callback
def log(level, text, user_data):
    sys.stderr.write(text.decode(errors="replace"))

llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
m.mtmd_helper_log_set(log, ctypes.c_void_p(0))
text_model, projector, flash, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
mp.n_gpu_layers = 999 if gpu else 0
model = llama_cpp.llama_model_load_from_file(text_model.encode(), mp)
params = m.mtmd_context_params_default()
params.use_gpu = gpu
params.warmup = True
params.flash_attn_type = flash
params.print_timings = False
ctx = m.mtmd_init_from_file(projector.encode(), model, params)
sys.exit(0 if ctx else 3)
"""


def measure(text_model: Path, projector: Path, flash: int, gpu: bool) -> tuple[float, bool, str]:
    """(compute buffer MiB on the device, whether clip ran flash attention, the device's name) from clip's log."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(text_model), str(projector), str(flash),
                           "1" if gpu else "0"], capture_output=True, text=True, timeout=1800)
    log = done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{projector.name} (flash_attn {flash}): exit {done.returncode}: {log.strip()[-600:]}")
    # the last verdict is the one kept (flash attention on, or off after a failed try)
    found = re.findall(r"warmup: flash attention is (enabled|disabled)", log)
    buffers = re.findall(r"alloc_compute_meta:\s+(\S+) compute buffer size =\s+([\d.]+) MiB", log) or \
        re.findall(r"reserve_compute_meta:\s+(\S+) compute buffer size =\s+([\d.]+) MiB", log)
    if not found or not buffers:
        raise SystemExit(f"{projector.name}: clip's log has no compute buffer line: {log.strip()[-600:]}")
    # (on a GPU the host's buffer for the inputs is logged too: the device's own is the one priced)
    ours = [b for b in buffers if b[0].startswith("CUDA") == gpu] or buffers
    device, size = max(ours, key=lambda b: float(b[1]))
    return float(size), found[-1] == "enabled", device


def gpu_name() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "a GPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", action="store_true", help="load on the first GPU (a CUDA build)")
    parser.add_argument("--text-model", type=Path,
                        help="the text model GGUF beside the projectors (default: the demo pair's target)")
    parser.add_argument("--synthetic-text", type=Path, metavar="VOCAB_GGUF",
                        help="instead: a tiny synthetic text model (bench/synthetic.py's TINY) with this GGUF's "
                        "tokenizer (a machine without the demo pair; the projector's output width follows it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic_text is not None:
            args.text_model = Path(tmp) / "text.gguf"
            write_pair(args.text_model, Path(tmp) / "draft.gguf", TINY, vocab_source=args.synthetic_text)
        elif args.text_model is None:
            from localspec.models import demo
            args.text_model = demo.target_path()
        rows = measure_all(args, Path(tmp))
    write_csv(args, rows)


def measure_all(args: argparse.Namespace, tmp: Path) -> list[dict[str, object]]:
    header = read_header(args.text_model).metadata
    args.n_embd_text = n_embd_text = int(header[f"{header['general.architecture']}.embedding_length"])
    rows: list[dict[str, object]] = []
    for name, spec, warmup_patches in (
            ("gemma3 (SigLIP 896 px)", gemma3_projector(n_embd_text), (896 // 14) ** 2),
            ("qwen-vl (1152 wide, 27 blocks)", qwen_vl_projector(n_embd_text), 46 * 46 * 4)):
        path = write_projector(tmp / "mmproj.gguf", spec)
        header = read_header(path)
        attention = memory.projector_attention_bytes(header, warmup_patches)
        activations = memory.projector_activation_bytes(header, warmup_patches)
        for flash in (1, 0):
            size, used, device = measure(args.text_model, path, flash, args.gpu)
            plan = activations + (0 if used else attention)
            rows.append({"projector": name, "flash_attn": "on" if flash else "off",
                         "flash_attn_used": "yes" if used else "no", "patches": warmup_patches,
                         "buffer_mib": round(size, 1), "plan_mib": round(plan / MIB, 1),
                         "attention_mib": round(attention / MIB, 1),
                         "activations_mib": round(activations / MIB, 1), "device": device})
            print(json.dumps(rows[-1]), flush=True)
        path.unlink()
    return rows


def write_csv(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    lines = [f"# written-by: bench/projector_memory.py {' '.join(sys.argv[1:])}",
             f"# command: python bench/projector_memory.py {' '.join(sys.argv[1:])}",
             "# source: each row's buffer_mib read by bench/projector_memory.py from clip.cpp's log in the process "
             "that loaded the projector (warm-up on); plan_mib from localspec.models.memory at the same picture",
             f"# date: {datetime.date.today().isoformat()}",
             f"# machine: {gpu_name() + ', ' if args.gpu else ''}{platform.machine()}, {os.cpu_count()} CPUs, "
             f"{platform.platform()}",
             "# what: libmtmd's compute buffer for each projector's warm-up picture (clip.cpp's log), flash attention "
             f"asked on and off, beside the memory plan's price; random-weight projectors at real dimensions (F16) "
             f"beside {args.text_model.name} (width {args.n_embd_text})"]
    with args.out.open("w", newline="", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
