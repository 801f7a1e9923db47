"""Hostile input end to end (issue #13): crafted GGUF headers, writes that fail, racing pulls and the smaller
cases, each through the real CLI in a subprocess. Every case checks the exit code, exactly one stderr line and no
traceback, and that nothing is left behind; the header cases also bound the process's peak memory.

Crafted files are a real tiny model (conftest's `tiny_pair`) with one metadata record replaced by hand-packed
bytes (tests/helpers_gguf.py), so each would load in llama.cpp but for that one record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from localspec.models import demo
from tests import helpers_gguf as G
from tests.conftest import BadFolder, fault_env, temp_files
from tests.helpers_hub import COMMIT, FakeHub, HubFile, cache_file
from tests.helpers_proc import as_from_a_terminal

# The entry point, plus a report of the process's peak RSS (VmHWM) at exit, for the memory bound.
_CLI = """
import atexit, os
def _peak():
    path = os.environ.get("LOCALSPEC_TEST_PEAK")
    if path and os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as fh:
            kb = next(line.split()[1] for line in fh if line.startswith("VmHWM:"))
        with open(path, "w") as out:
            out.write(kb)
atexit.register(_peak)
from localspec.cli.app import main
main()
"""
HEADER_MEMORY = 64 << 20  # a refused header costs at most this much above `localspec --version`


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    peak: int | None  # bytes; None where /proc is missing or the process died before atexit

    def one_error(self, rc: int, pattern: str) -> str:
        """Exit `rc` and exactly one stderr line, matching `pattern`, with no traceback."""
        assert "Traceback" not in self.stderr, self.stderr
        lines = self.stderr.splitlines()
        assert self.rc == rc and len(lines) == 1, (self.rc, self.stderr, self.stdout[-2000:])
        assert re.search(pattern, lines[0]), lines[0]
        return lines[0]


def cli(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None, tmp: Path) -> Run:
    peak_file = tmp / f"peak-{time.monotonic_ns()}"
    full_env = {**os.environ, **(env or {}), "LOCALSPEC_TEST_PEAK": str(peak_file), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", _CLI, *args], input=stdin, capture_output=True, env=full_env,
                          timeout=600)
    peak = int(peak_file.read_text()) * 1024 if peak_file.exists() else None
    return Run(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"), peak)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty LOCALSPEC_HOME for the subprocess (nothing of the developer's own)."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("LOCALSPEC_HOME", str(path))
    return path


@pytest.fixture(scope="module")
def baseline_peak(tmp_path_factory: pytest.TempPathFactory) -> int | None:
    return cli("--version", tmp=tmp_path_factory.mktemp("peak")).peak


# -- crafted headers --------------------------------------------------------------------------------------------

ARCH = "qwen3"  # the tiny pair's architecture
CRAFTED: dict[str, dict[str, bytes | None]] = {
    "no_layers": {f"{ARCH}.block_count": G.kv(f"{ARCH}.block_count", G.UINT32, 0)},
    "too_many_layers": {f"{ARCH}.block_count": G.kv(f"{ARCH}.block_count", G.UINT32, 513)},
    "layers_as_text": {f"{ARCH}.block_count": G.kv(f"{ARCH}.block_count", G.STRING, "4")},
    "uneven_kv_heads": {f"{ARCH}.attention.head_count_kv": G.kv(f"{ARCH}.attention.head_count_kv", G.UINT32, 3)},
    "bad_rope_scaling": {f"{ARCH}.rope.scaling.type": G.kv(f"{ARCH}.rope.scaling.type", G.STRING, "bogus")},
    "too_many_experts": {f"{ARCH}.expert_count": G.kv(f"{ARCH}.expert_count", G.UINT32, 2000)},
    "numeric_template": {"tokenizer.chat_template": G.kv("tokenizer.chat_template", G.UINT32, 7)},
    "bos_as_text": {"tokenizer.ggml.bos_token_id": G.kv("tokenizer.ggml.bos_token_id", G.STRING, "1")},
    "unchanged": {},
}


@pytest.fixture(scope="module")
def crafted(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from synthetic import read_vocab_kv, smollm2_vocab_path

    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("crafted")
    files = {name: G.rewrite(target, folder / f"{name}.gguf", changes) for name, changes in CRAFTED.items()}
    # The tiny pair's tokens are SmolLM2's (write_pair's vocabulary source), read once per session already.
    kvs, _ = read_vocab_kv(smollm2_vocab_path())
    tokens = list(next(kv.value for kv in kvs if kv.key == "tokenizer.ggml.tokens"))
    files["numeric_tokens"] = G.rewrite(target, folder / "numeric_tokens.gguf", {
        "tokenizer.ggml.tokens": G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.UINT32, list(range(len(tokens)))))})
    tokens[100] = tokens[101]  # llama.cpp asserts its token -> id map is as long as the vocabulary
    files["duplicate_token"] = G.rewrite(target, folder / "duplicate_token.gguf", {
        "tokenizer.ggml.tokens": G.kv("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, tokens))})
    files["nested"] = G.write(folder / "nested.gguf", [G.kv("general.architecture", G.STRING, ARCH),
                                                       G.kv("x", G.ARRAY, G.nested_arrays(1000))])
    return files


HEADER_CASES = [
    # (crafted file, command (T = the file, D = the tiny draft), expected stderr)
    ("no_layers", "generate hi --target T --draft D", r"block_count = 0 is out of range 1\.\.512"),
    ("no_layers", "generate hi --target T --ngl 0", r"block_count = 0 is out of range"),  # was a ZeroDivisionError
    ("too_many_layers", "bench --target T --draft D", r"block_count = 513 .*llama\.cpp's layer limit"),
    ("layers_as_text", "bench --target T --draft D", r"block_count is a string \('4'\), expected an integer"),
    ("uneven_kv_heads", "generate hi --target T", r"4 attention heads cannot share 3 KV heads"),
    ("bad_rope_scaling", "generate hi --target T", r"rope\.scaling\.type is a string \('bogus'\)"),
    ("too_many_experts", "generate hi --target T", r"expert_count = 2000 .*expert limit"),
    ("duplicate_token", "generate hi --target T", r"tokens 100 and 101 are both"),
    ("numeric_tokens", "check T D", r"tokenizer\.ggml\.tokens is an array of 49152 uint32 values"),
    ("numeric_tokens", "generate hi --target T --draft D", r"expected an array of strings"),
    ("numeric_template", "check T D", r"tokenizer\.chat_template is an integer \(7\), expected a string"),
    ("numeric_template", "generate hi --chat --target T", r"tokenizer\.chat_template is an integer"),
    ("bos_as_text", "check D T", r"tokenizer\.ggml\.bos_token_id is a string"),
    ("nested", "check T D", r"'x' nests arrays more than 3 deep"),
    ("nested", "generate hi --target T", r"'x' nests arrays more than 3 deep"),
]
# The fast lane runs one case per command; the rest run with the slow tests (each case is a CLI process).
FAST_HEADER_CASES = {("no_layers", "generate hi --target T --ngl 0"), ("too_many_layers", "bench --target T --draft D"),
                     ("numeric_tokens", "check T D")}


@pytest.mark.parametrize(("name", "command", "message"),
                         [c if c[:2] in FAST_HEADER_CASES else pytest.param(*c, marks=pytest.mark.slow)
                          for c in HEADER_CASES], ids=[f"{c[0]}:{c[1].split()[0]}" for c in HEADER_CASES])
def test_a_crafted_header_gets_one_line_before_llama_cpp_sees_it(
    name: str, command: str, message: str, crafted: dict[str, Path], tiny_pair: tuple[Path, Path], home: Path,
    tmp_path: Path, baseline_peak: int | None,
) -> None:
    args = [{"T": str(crafted[name]), "D": str(tiny_pair[1])}.get(a, a) for a in command.split()]
    run = cli(*args, tmp=tmp_path)
    line = run.one_error(2, message)
    assert str(crafted[name]) in line  # the culprit is named
    if run.peak is not None and baseline_peak is not None:
        assert run.peak < baseline_peak + HEADER_MEMORY, (run.peak, baseline_peak)


@pytest.mark.parametrize("name", ["nested", *(pytest.param(n, marks=pytest.mark.slow)
                                              for n in ("numeric_tokens", "layers_as_text"))])
def test_doctor_shows_a_crafted_header_as_its_failing_line(name: str, crafted: dict[str, Path],
                                                           tiny_pair: tuple[Path, Path], home: Path,
                                                           tmp_path: Path) -> None:
    run = cli("doctor", "--target", str(crafted[name]), "--draft", str(tiny_pair[1]), tmp=tmp_path)
    assert run.rc == 1 and run.stderr == "", run.stderr
    assert re.search(rf"✗ model files: {re.escape(str(crafted[name]))}: ", run.stdout), run.stdout


@pytest.mark.slow
def test_the_unchanged_rewrite_loads_so_each_refusal_is_the_crafted_record(
    crafted: dict[str, Path], tiny_pair: tuple[Path, Path], home: Path, tmp_path: Path
) -> None:
    run = cli("generate", "hi", "--target", str(crafted["unchanged"]), "--draft", str(tiny_pair[1]),
              "--max-tokens", "4", "--temp", "0", tmp=tmp_path)
    assert run.rc == 0 and run.stdout and "error" not in run.stderr, run.stderr  # (stderr notes the token limit)


USER_PAIR = """
[[pair]]
name = "tiny"
description = "a pair whose target is cached but corrupt"
n_ctx = 1024
n_draft = 4

[pair.target]
repo = "org/tiny-target"
file = "target.gguf"
quant = "Q4_0"
family = "test"
license = "mit"

[pair.draft]
repo = "org/tiny-draft"
file = "draft.gguf"
quant = "Q4_0"
family = "test"
license = "mit"
"""


def test_models_shows_one_corrupt_cached_file_as_an_unreadable_row(
    crafted: dict[str, Path], tiny_pair: tuple[Path, Path], home: Path, tmp_path: Path
) -> None:
    (home / "models.toml").write_text(USER_PAIR)
    cache_file(tmp_path / "hub", "org/tiny-target", "target.gguf", crafted["nested"].read_bytes())
    cache_file(tmp_path / "hub", "org/tiny-draft", "draft.gguf", tiny_pair[1].read_bytes())
    run = cli("models", env={"HF_HUB_CACHE": str(tmp_path / "hub")}, tmp=tmp_path)
    assert run.rc == 0 and run.stderr == "", run.stderr
    row = next(line for line in run.stdout.splitlines() if " tiny " in line)
    assert "unreadable" in row
    assert re.search(r"✗ .*target\.gguf: metadata 'x' nests arrays", run.stdout)
    assert re.search(r"\bdemo\b", run.stdout) and "qwen2.5-coder-32b" in run.stdout  # the others still listed


# -- writes that fail ---------------------------------------------------------------------------------------------

QUICK_BENCH = ["--repeat", "1", "--warmup", "0", "--max-tokens", "4"]


def _bench(tiny_pair: tuple[Path, Path], *extra: str) -> list[str]:
    return ["bench", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), *QUICK_BENCH, *extra]


@pytest.mark.parametrize("where", ["readonly", pytest.param("directory", marks=pytest.mark.slow)])
def test_bench_json_is_refused_before_the_benchmark(where: str, readonly_dir: BadFolder, tiny_pair, home: Path,
                                                    tmp_path: Path) -> None:
    if where == "readonly":
        target, env = readonly_dir.path / "report.json", readonly_dir.env
    else:
        target, env = tmp_path / "report.json", {}
        target.mkdir()
    run = cli(*_bench(tiny_pair, "--json", str(target)), env=env, tmp=tmp_path)
    run.one_error(2, rf"cannot write bench report {re.escape(str(target))}: "
                     "(read-only file system|permission denied|it is a directory)")
    assert "localspec bench" not in run.stdout  # refused before any model was loaded
    assert temp_files(target.parent) == []


def test_bench_json_on_a_full_disk_is_refused_before_the_benchmark(full_dir: BadFolder, tiny_pair, home: Path,
                                                                   tmp_path: Path) -> None:
    if full_dir.how != "tmpfs":
        pytest.skip("no tmpfs here: the disk-fills-during-the-run test below covers a full disk")
    target = full_dir.path / "report.json"
    run = cli(*_bench(tiny_pair, "--json", str(target)), tmp=tmp_path)
    run.one_error(2, rf"cannot write bench report {re.escape(str(target))}: the disk is full \(0 bytes free\)")
    assert "localspec bench" not in run.stdout and temp_files(full_dir.path) == []


@pytest.mark.slow
def test_bench_json_failing_after_the_run_still_prints_the_report(tiny_pair, home: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / "report.json"
    run = cli(*_bench(tiny_pair, "--json", str(target)), env=fault_env("fsync", "ENOSPC", out), tmp=tmp_path)
    run.one_error(2, rf"cannot write bench report {re.escape(str(target))}: the disk is full; "
                     "the report is printed above instead")
    assert "median" in run.stdout  # the summary table came first
    report = json.loads(run.stdout[run.stdout.index("\n{") + 1:])
    assert report["plain"]["runs"] == 1 and "greedy_check" in report
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_sweep_save_preset_failing_late_prints_the_preset(tiny_pair, home: Path, tmp_path: Path) -> None:
    presets = home / "presets"
    presets.mkdir()
    run = cli(*_bench(tiny_pair, "--sweep", "2", "--save-preset", "tuned"),
              env=fault_env("fsync", "ENOSPC", presets), tmp=tmp_path)
    run.one_error(2, r"cannot write preset .*tuned\.toml: the disk is full; the preset is printed above instead")
    assert "best draft length here: " in run.stdout and "[draft]\nn_draft = 2" in run.stdout
    assert list(presets.iterdir()) == []


@pytest.mark.parametrize("where", ["readonly", *(pytest.param(w, marks=pytest.mark.slow)
                                                 for w in ("full", "directory"))])
def test_sweep_save_preset_is_refused_before_the_sweep(where: str, readonly_dir: BadFolder, full_dir: BadFolder,
                                                       tiny_pair, tmp_path: Path, monkeypatch) -> None:
    env: dict[str, str] = {}
    if where == "directory":
        home = tmp_path / "home"
        (home / "presets" / "tuned.toml").mkdir(parents=True)
    else:
        bad = readonly_dir if where == "readonly" else full_dir
        if bad.how == "fault" and where == "full":
            pytest.skip("a fault-injected full disk only fails the write itself: covered by the late-failure test")
        home, env = bad.path, bad.env
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    run = cli(*_bench(tiny_pair, "--sweep", "2", "--save-preset", "tuned"), env=env, tmp=tmp_path)
    run.one_error(2, r"cannot write preset .*tuned\.toml: "
                     "(read-only file system|permission denied|the disk is full|it is a directory)")
    assert "localspec bench" not in run.stdout and temp_files(home) == []


@pytest.mark.parametrize("where", ["readonly", *(pytest.param(w, marks=pytest.mark.slow)
                                                 for w in ("full", "directory"))])
def test_models_default_on_a_bad_home(where: str, readonly_dir: BadFolder, full_dir: BadFolder, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    if where == "directory":
        home = tmp_path / "home"
        (home / "default-pair").mkdir(parents=True)
    else:
        bad = readonly_dir if where == "readonly" else full_dir
        home, env = bad.path, bad.env
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    run = cli("models", "--default", "demo", env=env, tmp=tmp_path)
    run.one_error(2, r"cannot write the default pair to .*default-pair: "
                     "(read-only file system|permission denied|the disk is full|it is a directory)")
    assert temp_files(home) == []


def test_a_read_only_home_cannot_build_the_demo_and_says_what_to_do(readonly_dir: BadFolder, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSPEC_HOME", str(readonly_dir.path))
    run = cli("generate", "hi", env=readonly_dir.env, tmp=tmp_path)
    run.one_error(2, r"cannot write demo model .*: (read-only file system|permission denied) "
                     r"\(the demo pair is built once into \$LOCALSPEC_HOME/cache/demo")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["full", "directory"])
def test_the_demo_build_on_a_full_disk_or_a_directory_leaves_nothing(where: str, full_dir: BadFolder,
                                                                    tmp_path: Path, monkeypatch) -> None:
    if where == "full":
        home, env = full_dir.path, full_dir.env
    else:
        home, env = tmp_path / "home", {}
        (home / "cache" / "demo" / demo.TARGET_FILE).mkdir(parents=True)
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    run = cli("generate", "hi", env=env, tmp=tmp_path)
    run.one_error(2, rf"cannot write demo model .*{demo.TARGET_FILE}: (the disk is full|it is a directory)")
    assert temp_files(home) == []


@pytest.mark.slow
def test_sigterm_during_the_first_demo_build_leaves_no_partial_file(home: Path, tmp_path: Path) -> None:
    demo_dir = home / "cache" / "demo"
    proc = subprocess.Popen([sys.executable, "-c", _CLI, "generate", "hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (demo_dir.is_dir() and temp_files(demo_dir)):  # the first model is being assembled
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and err.decode() == "localspec: terminated\n", err
    assert temp_files(home) == [] and not (demo_dir / demo.TARGET_FILE).exists()


# -- racing pulls, and what a hub can say ----------------------------------------------------------------------

CONTENT = os.urandom(3 << 20)


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = FakeHub().start()
    for key, value in {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"),
                       "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "LOCALSPEC_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield server
    server.stop()


@pytest.mark.slow
def test_two_pulls_of_one_file_wait_for_each_other(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.files[("org/big", "model.gguf")] = HubFile(CONTENT, seconds_per_mib=1.0)
    args = [sys.executable, "-c", _CLI, "pull", "--target", "org/big:model.gguf"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = tmp_path / "hf" / "hub" / "models--org--big" / "blobs" / (hashlib.sha256(CONTENT).hexdigest()
                                                                          + ".localspec-partial")
    deadline = time.monotonic() + 60
    while not partial.exists():  # the first pull holds the lock and is writing
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    second = subprocess.run(args, capture_output=True, timeout=120)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and err == b"", err
    assert second.returncode == 0 and second.stderr == b"", second.stderr
    said = " ".join(second.stdout.decode().split())  # rich wraps long lines at 80 columns
    assert f"model.gguf is already downloading in process {first.pid}: waiting for it to finish" in said
    assert "✓" in out.decode() and "✓" in said
    snapshot = tmp_path / "hf" / "hub" / "models--org--big" / "snapshots" / COMMIT / "model.gguf"
    assert snapshot.read_bytes() == CONTENT
    assert len([r for r in fake_hub.gets("model.gguf") if r[2] is None or r[2].startswith("bytes=0")]) == 1
    assert not partial.exists()


def test_a_body_longer_than_announced_is_named_without_huggingface_hub_advice(fake_hub: FakeHub,
                                                                             tmp_path: Path) -> None:
    fake_hub.files[("org/liar", "model.gguf")] = HubFile(CONTENT, advertised_size=len(CONTENT) - 1000)
    run = cli("pull", "--target", "org/liar:model.gguf", tmp=tmp_path)
    run.one_error(2, rf"model\.gguf: the server sent {len(CONTENT)} bytes where it announced "
                     rf"{len(CONTENT) - 1000}; removed, pull again")
    assert "force_download" not in run.stderr + run.stdout
    assert temp_files(tmp_path / "hf") == [] and not list((tmp_path / "hf").rglob("*.localspec-partial"))


# -- the smaller cases --------------------------------------------------------------------------------------------


def test_invalid_utf8_on_stdin(home: Path, tmp_path: Path, tiny_pair) -> None:
    run = cli("generate", "-", "--target", str(tiny_pair[0]), stdin=b"caf\xe9 \xff", tmp=tmp_path)
    run.one_error(2, r"stdin: not UTF-8 text \(byte 0xe9 at offset 3\)")


@pytest.mark.parametrize("which", ["models.toml", *(pytest.param(w, marks=pytest.mark.slow)
                                                     for w in ("preset", "default-pair"))])
def test_non_utf8_config_files(which: str, home: Path, tmp_path: Path, demo_home: Path) -> None:
    bad = b'# caf\xe9\n'
    if which == "preset":
        path = tmp_path / "latin1.toml"
        path.write_bytes(bad)
        run = cli("doctor", "--preset", str(path), env={"LOCALSPEC_HOME": str(demo_home)}, tmp=tmp_path)
    else:
        path = home / which
        path.write_bytes(bad)
        run = cli("models", tmp=tmp_path)
    run.one_error(2, rf"{re.escape(str(path))}: not UTF-8 text \(byte 0xe9 at offset 5\)")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("pair = [1]\n", r"models\.toml:1: pair #1 = 1: expected a \[\[pair\]\] table"),
        (USER_PAIR.replace('file = "target.gguf"', 'file = "../x.gguf"'),
         r"models\.toml:\d+: file '\.\./x\.gguf': a file name without folders or '\.\.'"),
        pytest.param(USER_PAIR.replace('file = "target.gguf"', 'file = "sub/x.gguf"'),
                     r"file 'sub/x\.gguf': a file name", marks=pytest.mark.slow),
    ],
)
def test_models_toml_shapes_that_used_to_crash(toml: str, message: str, home: Path, tmp_path: Path) -> None:
    (home / "models.toml").write_text(toml)
    cli_run = cli("models", tmp=tmp_path)
    cli_run.one_error(2, message)


def test_a_pulled_file_name_cannot_leave_the_cache(home: Path, tmp_path: Path) -> None:
    cli("pull", "--target", "org/x:../../evil.gguf", tmp=tmp_path).one_error(2, r"expected REPO:FILE")


def test_a_preset_name_cannot_leave_the_presets_folder(home: Path, tmp_path: Path, tiny_pair) -> None:
    run = cli(*_bench(tiny_pair, "--sweep", "2", "--save-preset", "../../evil"), tmp=tmp_path)
    run.one_error(2, r"preset name '\.\./\.\./evil': use letters, digits")


@pytest.mark.slow
def test_context_full_says_so_and_exits_3(home: Path, tmp_path: Path, tiny_pair) -> None:
    run = cli("generate", "hi", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
              "--max-tokens", "100000", "--ctx", "128", "--temp", "0", tmp=tmp_path)
    run.one_error(3, r"^localspec: stopped: context full \(128 tokens\)$")
    assert run.stdout  # the text generated until then still reached stdout


@pytest.mark.slow
def test_ctrl_c_says_interrupted_and_exits_130(home: Path, tiny_pair) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI, "generate", "hi", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
         "--max-tokens", "100000", "--ctx", "8192"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,
    )
    assert proc.stdout is not None and proc.stdout.read(1)  # generating
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.decode() == "localspec: interrupted\n", err


@pytest.mark.parametrize("kind", ["fifo", pytest.param("directory", marks=pytest.mark.slow)])
@pytest.mark.parametrize("command", ["generate", pytest.param("check", marks=pytest.mark.slow)])
def test_a_directory_or_fifo_as_a_model_says_what_it_is(kind: str, command: str, home: Path, tmp_path: Path,
                                                       tiny_pair) -> None:
    path = tmp_path / "model.gguf"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    args = ["generate", "hi", "--target", str(path)] if command == "generate" else ["check", str(path),
                                                                                     str(tiny_pair[1])]
    run = cli(*args, tmp=tmp_path)
    run.one_error(2, rf"{re.escape(str(path))}: is a {'directory' if kind == 'directory' else 'FIFO'}")


def test_an_unreadable_file_is_one_line_not_a_usage_box(home: Path, tmp_path: Path, tiny_pair) -> None:
    path = tmp_path / "secret.gguf"
    path.write_bytes(tiny_pair[1].read_bytes())
    env: dict[str, str] = {}
    if os.geteuid() == 0:  # permission bits do not stop root: make the calls fail the same way
        env = fault_env("read", "EACCES", path)
    else:
        path.chmod(0)
    run = cli("check", str(path), str(tiny_pair[1]), env=env, tmp=tmp_path)
    run.one_error(2, rf"{re.escape(str(path))}: cannot read: Permission denied")
