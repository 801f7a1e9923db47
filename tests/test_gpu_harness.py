"""bench/gpu/harness.sh is the GPU benchmarks' one harness: every script that runs on the GPU machine sources it and
copies none of its setup; its steps keep to the time budget and record what they did (bash, no GPU, no model)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "bench" / "gpu" / "harness.sh"
# What only the harness may define: the folders and budget, the log and steps, the Python path and llama.cpp build,
# the machine snapshot, the stand-in pairs' writer, the prompt files, localspec's command line.
SETUP = {
    "the start time": r"^\s*T0=",
    "the repository root": r"^\s*REPO=",
    "the default folders": r"^\s*(CARRY|WORK|OUT)=\"\$\{(CARRY|WORK|OUT):-",
    "the budget's default": r"^\s*BUDGET_S=\"\$\{BUDGET_S:-",
    "log/left/run": r"^\s*(log|left|run|step)\(\)",
    "the Python path": r"export PYTHONPATH=",
    "the llama.cpp library path": r"export (LLAMA_CPP_LIB_PATH|LD_LIBRARY_PATH)=",
    "the machine snapshot": r"nvidia-smi --query-gpu",
    "localspec's command line": r"^\s*LOCALSPEC=\(",
    "the prompt files": r"from localspec\.bench import PROMPTS",
    "the build through run.sh": r"SCALES=\"\" CARD_NOISES=\"\"",
    "the real model's assembly": r"cat \$REAL_PARTS",
    "the embedded pair's writer": r"python3 \"\$REPO/bench/embed\.py\"",
}


def gpu_scripts() -> list[Path]:
    """Every shell script that runs on the GPU machine: bench/gpu's and the lab's probes that use its build."""
    scripts = [p for p in sorted((ROOT / "bench" / "gpu").glob("*.sh")) if p != HARNESS]
    scripts += [p for p in sorted((ROOT / "bench" / "lab").glob("*.sh")) if "WORK" in p.read_text()]
    return scripts


def test_there_are_gpu_scripts() -> None:
    names = {p.name for p in gpu_scripts()}
    assert {"run.sh", "concurrency.sh", "drafters.sh", "multi_gpu.sh", "make_archive.sh"} <= names


@pytest.mark.parametrize("script", gpu_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_gpu_script_sources_the_harness_and_copies_none_of_it(script: Path) -> None:
    text = script.read_text()
    assert re.search(r'^source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/(\.\./gpu/)?harness\.sh"', text, re.M), \
        f"{script.name} does not source bench/gpu/harness.sh"
    copied = [what for what, pattern in SETUP.items() if re.search(pattern, text, re.M)]
    assert not copied, f"{script.name} copies the harness's {', '.join(copied)}"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -uo pipefail; source {HARNESS}; {script}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work"), **env})


def test_a_step_runs_when_the_budget_has_room_and_is_skipped_and_recorded_when_not(tmp_path: Path) -> None:
    r = bash('results_in "$WORK/res"; hello() { echo "hi $1"; }; export -f hello; run greet 5 hello there; '
             'echo "rc=$?"; run late 999 true; echo "rc=$?"', tmp_path, BUDGET_S="100")
    assert "hi there" in r.stdout and "rc=0" in r.stdout and "rc=99" in r.stdout, r.stdout + r.stderr
    assert "SKIP late: " in r.stdout and "needs ~999s" in r.stdout
    steps = [line.split("\t")[:2] for line in (tmp_path / "work" / "res" / "steps.tsv").read_text().splitlines()]
    assert steps == [["greet", "0"], ["late", "skipped"]]
    assert (tmp_path / "work" / "out").is_dir()  # OUT defaults inside WORK


def test_the_synthetic_pairs_vocabulary_follows_their_size(tmp_path: Path) -> None:
    show = 'vocab_args {}; echo "[${{VOCAB_ARGS[*]}}]"'
    r = bash("; ".join(show.format(size) for size in ("card32b", "gpu32b", "hybrid27b", "card-tiny", "tiny",
                                                      "hybrid-tiny")), tmp_path, CARRY="/c")
    assert r.stdout.split() == ["[--vocab", "/c/ggml-vocab-qwen2.gguf]"] * 3 + ["[]"] * 3, r.stdout + r.stderr
    mine = bash("vocab_args card32b; echo \"[${VOCAB_ARGS[*]}]\"", tmp_path, VOCAB="/v.gguf")
    assert mine.stdout.strip() == "[--vocab /v.gguf]"
    none = bash("vocab_args card32b; echo \"[${VOCAB_ARGS[*]}]\"", tmp_path, VOCAB="")
    assert none.stdout.strip() == "[]"


def test_use_build_puts_the_carried_packages_and_the_build_first(tmp_path: Path) -> None:
    (tmp_path / "work" / "build" / "bin").mkdir(parents=True)
    (tmp_path / "work" / "build" / "bin" / "libllama.so").touch()
    r = bash('use_build; echo "$PYTHONPATH|$LLAMA_CPP_LIB_PATH"', tmp_path)
    assert r.stdout.strip() == f"{tmp_path}/work/pyenv/py:{ROOT}|{tmp_path}/work/build/bin", r.stderr
    local = bash('use_build; echo "$PYTHONPATH"', tmp_path, CARRIED_PY="0")
    assert local.stdout.strip() == str(ROOT)
    # libmtmd where the build has it: llama-cpp-python's image bindings load it from there (--mmproj)
    assert bash('use_build; echo "${MTMD_CPP_LIB:-none}"', tmp_path).stdout.strip() == "none"
    (tmp_path / "work" / "build" / "bin" / "libmtmd.so").touch()
    assert bash('use_build; echo "$MTMD_CPP_LIB"', tmp_path).stdout.strip() == f"{tmp_path}/work/build/bin"


def test_concurrency_sh_with_pictures_gives_every_server_the_projector_and_the_client_the_picture() -> None:
    """MMPROJ: the same projector for localspec and llama-server, the same picture in every request, results apart."""
    text = (ROOT / "bench" / "gpu" / "concurrency.sh").read_text()
    assert text.count('"${PROJECTOR[@]}"') == 3  # localspec (k0, spec), llama-server with a draft, without
    assert '"${PICTURE[@]}"' in text and 'PROJECTOR=(--mmproj "$mm") PICTURE=(--image "$png")' in text
    assert '--projector "$MMPROJ"' in text and 's="$s+$MMPROJ"' in text


def concurrency_server_cmd(pair_target: str, pair_draft: str, config: str) -> list[str]:
    """concurrency.sh's server_cmd (the script measures when run) for one configuration, as a word list."""
    text = (ROOT / "bench" / "gpu" / "concurrency.sh").read_text()
    match = re.search(r"^server_cmd\(\) \{.*?^\}$", text, re.M | re.S)
    assert match, "concurrency.sh defines no server_cmd()"
    script = (f"LOCALSPEC=(localspec) LLAMA_SERVER=llama-server DRAFT_MAX=3 PARALLEL=16 CTX=2048 LOCALSPEC_CTX=2048 "
              f"PORT=1 SEED=42 PROJECTOR=() SERVER_CMD=(); {match.group(0)}\n"
              f"server_cmd {config} {pair_target} {pair_draft} && printf '%s\\n' \"${{SERVER_CMD[@]}}\"")
    r = subprocess.run(["bash", "-c", f"set -uo pipefail; {script}"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_concurrency_sh_serves_the_hybrids_mtp_head_on_both_sides_and_a_draft_model_otherwise() -> None:
    """PAIRS=hybrid-mtp has no draft model ("-"): localspec drafts with the target's MTP head, llama-server with its
    draft-mtp loop, neither given a draft file; a card pair's draft model goes to both as before."""
    spec = concurrency_server_cmd("T.gguf", "-", "spec")
    assert spec[spec.index("--drafter") + 1] == "mtp" and spec[spec.index("--draft") + 1] == "3" and "-" not in spec
    theirs = concurrency_server_cmd("T.gguf", "-", "llamaprob")
    assert theirs[theirs.index("--spec-type") + 1] == "draft-mtp" and "-md" not in theirs and "-ngld" not in theirs
    assert "--spec-draft-sampling" in theirs and "-" not in theirs
    plain = concurrency_server_cmd("T.gguf", "-", "k0")
    assert plain[plain.index("--drafter") + 1] == "mtp" and plain[plain.index("--draft") + 1] == "0"
    card = concurrency_server_cmd("T.gguf", "D.gguf", "llama")
    assert card[card.index("-md") + 1] == "D.gguf" and card[card.index("--spec-type") + 1] == "draft-simple"
    ours = concurrency_server_cmd("T.gguf", "D.gguf", "spec")
    assert ours[ours.index("--draft") + 1] == "D.gguf" and "--drafter" not in ours
    text = (ROOT / "bench" / "gpu" / "concurrency.sh").read_text()
    assert 'hybrid-mtp) [[ -f "$(hybrid_target)" ]] && echo "$(hybrid_target) -"' in text


def test_the_hybrid_target_is_named_once_and_written_only_when_missing(tmp_path: Path) -> None:
    """harness.sh names the hybrid target for grid.sh, hybrid.sh and concurrency.sh; its writer leaves a file that is
    there alone (no Python is run: this PATH has none of the carried packages)."""
    named = bash('echo "$(hybrid_target)"', tmp_path, HYBRID_SIZE="hybrid-tiny", MTP_NOISE="0.2")
    assert named.stdout.strip() == f"{tmp_path}/work/models/hybrid-tiny-n0.2-target.gguf"
    # Another preset's (hybrid.sh's ALSO_WRITE: the file a later call's HYBRID_SIZE looks for).
    other = bash('echo "$(hybrid_target hybrid35b-a3b)"', tmp_path, HYBRID_SIZE="hybrid-tiny", MTP_NOISE="0.2")
    assert other.stdout.strip() == f"{tmp_path}/work/models/hybrid35b-a3b-n0.2-target.gguf"
    hybrid = (ROOT / "bench" / "gpu" / "hybrid.sh").read_text()
    assert 'for size in ${ALSO_WRITE:-}; do [[ -f "$(hybrid_target "$size")" ]]' in hybrid
    assert 'write_hybrid_target "$RES/write-$size.log" "$size"' in hybrid  # (the harness's one writer)
    harness = (ROOT / "bench" / "gpu" / "harness.sh").read_text()
    assert '--prefix "$size-n$MTP_NOISE-"' in harness  # (what hybrid_target "$size" names)
    (tmp_path / "work" / "models").mkdir(parents=True)
    (tmp_path / "work" / "models" / "hybrid27b-n0.1-target.gguf").write_text("kept")
    r = bash('write_hybrid_target "$WORK/write.log"; echo "rc=$?"', tmp_path, CARRIED_PY="0")
    assert "rc=0" in r.stdout and not (tmp_path / "work" / "write.log").exists(), r.stderr
    (tmp_path / "work" / "models" / "hybrid35b-a3b-n0.1-target.gguf").write_text("kept")  # another preset's
    r = bash('write_hybrid_target "$WORK/write.log" hybrid35b-a3b; echo "rc=$?"', tmp_path, CARRIED_PY="0")
    assert "rc=0" in r.stdout and not (tmp_path / "work" / "write.log").exists(), r.stderr
    for script in ("grid.sh", "hybrid.sh"):
        text = (ROOT / "bench" / "gpu" / script).read_text()
        assert "$(hybrid_target)" in text and 'HYBRID_SIZE="${HYBRID_SIZE:-' not in text, script


def test_the_pinned_build_needs_no_llama_server_where_the_newest_ones_is_compared(tmp_path: Path) -> None:
    """concurrency.sh compares the newest llama-server where it builds it, so the pinned tree leaves llama-server
    out (PINNED_SERVER=0: ~80 s of an H100 call) and have_build does not ask for it there."""
    bin_ = tmp_path / "work" / "build" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "libllama.so").touch()
    (bin_ / "llama-speculative-simple").touch(mode=0o755)
    assert bash("have_build llama-server; echo rc=$?", tmp_path).stdout.strip() == "rc=1"
    assert bash("have_build llama-server; echo rc=$?", tmp_path, PINNED_SERVER="0").stdout.strip() == "rc=0"
    text = (ROOT / "bench" / "gpu" / "concurrency.sh").read_text()
    assert ('[[ "$NEWEST" == 1 && "${LLAMA_YARDSTICK:-}" != pinned ]] && export PINNED_SERVER="${PINNED_SERVER:-0}"'
            in text)
    assert 'build_current "$BIN" "$SRC" "$CARRY/llama.cpp.tar.gz" "$PINNED_SERVER"' in RUN_SH.read_text()


def test_a_real_model_carried_in_parts_is_assembled_once_all_are_there_and_match(tmp_path: Path) -> None:
    import hashlib

    parts = [tmp_path / "p1", tmp_path / "p2"]
    parts[0].write_bytes(b"GGUF-first-")
    env = {"REAL_PARTS": " ".join(map(str, parts)), "BUDGET_S": "100"}
    show = 'results_in "$WORK/res"; assemble_real; [[ -f "$REAL_TARGET" ]] && cat "$REAL_TARGET" || echo none'
    early = bash(show, tmp_path, **env)
    assert early.stdout.splitlines()[-1] == "none" and "not all here yet" in early.stdout, early.stdout + early.stderr
    parts[1].write_bytes(b"second")
    wrong = bash(show, tmp_path, REAL_SHA256="0" * 64, **env)
    assert wrong.stdout.splitlines()[-1] == "none" and "sha256 differs" in wrong.stdout
    assert not (tmp_path / "work" / "models" / "real.gguf.tmp").exists()
    sha = hashlib.sha256(b"GGUF-first-second").hexdigest()
    whole = bash(show, tmp_path, REAL_SHA256=sha, **env)
    assert whole.stdout.splitlines()[-1] == "GGUF-first-second", whole.stdout + whole.stderr
    parts[1].write_bytes(b"changed")  # made once: a later call keeps the file
    assert bash(show, tmp_path, **env).stdout.splitlines()[-1] == "GGUF-first-second"


def test_the_embedded_pair_is_written_only_from_a_real_model_and_reused_once_there(tmp_path: Path) -> None:
    show = 'results_in "$WORK/res"; speaks_pair card32b; echo "rc=$?"; echo "$(speaks_target card32b)"'
    none = bash(show, tmp_path, BUDGET_S="100")
    assert none.stdout.split()[-2:] == ["rc=1", f"{tmp_path}/work/models/speaks-card32b-target.gguf"], none.stderr
    assert "write-speaks" not in none.stdout  # no real model: nothing to embed, no step run
    models = tmp_path / "work" / "models"
    models.mkdir(parents=True, exist_ok=True)  # (the harness made WORK's folders)
    for role in ("target", "draft"):
        (models / f"speaks-card32b-{role}.gguf").write_bytes(b"GGUF")
    (tmp_path / "real.gguf").write_bytes(b"GGUF")
    there = bash(show, tmp_path, BUDGET_S="100", REAL_TARGET=str(tmp_path / "real.gguf"))
    assert "rc=0" in there.stdout and "write-speaks" not in there.stdout, there.stdout + there.stderr
    # A weaker draft (the real model requantized) has a file of its own beside the same target.
    weaker = 'results_in "$WORK/res"; echo "$(speaks_draft card32b)"; speaks_pair card32b; echo "rc=$?"'
    (models / "speaks-card32b-dq2_k-draft.gguf").write_bytes(b"GGUF")
    named = bash(weaker, tmp_path, BUDGET_S="100", REAL_TARGET=str(tmp_path / "real.gguf"), SPEAKS_DRAFT_FTYPE="Q2_K")
    assert named.stdout.split()[0] == f"{models}/speaks-card32b-dq2_k-draft.gguf", named.stdout + named.stderr
    assert "rc=0" in named.stdout and "write-speaks" not in named.stdout and "requantize" not in named.stdout


def _tool(folder: Path, says: str) -> None:
    """A stand-in llama-speculative-simple (and libllama.so) in a build's bin folder that prints `says`, its
    arguments and the library path it was started with."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "libllama.so").touch()
    tool = folder / "llama-speculative-simple"
    tool.write_text(f'#!/bin/sh\necho "{says} $* LD=$LD_LIBRARY_PATH"\n')
    tool.chmod(0o755)


def test_the_yardstick_is_the_newest_build_where_it_exists_unless_the_pinned_one_is_asked_for(tmp_path: Path) -> None:
    work = tmp_path / "work"
    show = ('results_in "$WORK/res"; use_build; yardstick; echo "rc=$? $YARDSTICK $YARDSTICK_BIN"; '
            '"$YARDSTICK_BIN/llama-speculative-simple" --version')
    _tool(work / "build" / "bin", "pinned")
    alone = bash(show, tmp_path)
    assert alone.stdout.splitlines()[-2:] == [f"rc=0 pinned {work}/build/bin",
                                              f"pinned --version LD={work}/build/bin"], alone.stdout + alone.stderr
    _tool(work / "build-newest" / "bin", "newest")
    newest = bash(show, tmp_path)
    # through a wrapper that puts the newest build's libraries before the pinned ones use_build names
    assert newest.stdout.splitlines()[-2:] == [f"rc=0 newest {work}/yardstick-newest",
                                               f"newest --version LD={work}/build-newest/bin:{work}/build/bin"], \
        newest.stdout + newest.stderr
    asked = bash(show, tmp_path, LLAMA_YARDSTICK="pinned")
    assert asked.stdout.splitlines()[-1] == f"pinned --version LD={work}/build/bin"
    wrong = bash('results_in "$WORK/res"; yardstick; echo "rc=$?"', tmp_path, LLAMA_YARDSTICK="latest")
    assert "LLAMA_YARDSTICK=latest: expected newest or pinned" in wrong.stdout and "rc=1" in wrong.stdout
    (work / "build-newest" / "bin" / "llama-speculative-simple").unlink()
    missing = bash('results_in "$WORK/res"; yardstick; echo "rc=$?"', tmp_path, LLAMA_YARDSTICK="newest")
    assert "LLAMA_YARDSTICK=newest: no llama-speculative-simple in" in missing.stdout and "rc=1" in missing.stdout


def test_the_yardsticks_llama_server_is_wrapped_beside_its_speculative_tool(tmp_path: Path) -> None:
    """concurrency.sh's llama-server is the newest build's where it has one, started with its own libraries first;
    a newest build without llama-server gets no wrapper (the script then leaves llama-server's rows empty)."""
    work = tmp_path / "work"
    _tool(work / "build" / "bin", "pinned")
    _tool(work / "build-newest" / "bin", "newest")
    show = 'results_in "$WORK/res"; use_build; yardstick; ls "$YARDSTICK_BIN"'
    assert bash(show, tmp_path).stdout.split() == ["llama-speculative-simple"]
    server = work / "build-newest" / "bin" / "llama-server"
    server.write_text('#!/bin/sh\necho "newest server $* LD=$LD_LIBRARY_PATH"\n')
    server.chmod(0o755)
    ran = bash(show + '; "$YARDSTICK_BIN/llama-server" --version', tmp_path)
    assert ran.stdout.splitlines()[-3:] == ["llama-server", "llama-speculative-simple",
                                            f"newest server --version LD={work}/build-newest/bin:{work}/build/bin"], \
        ran.stdout + ran.stderr


RUN_SH = ROOT / "bench" / "gpu" / "run.sh"


def run_sh_functions(*names: str) -> str:
    """run.sh's definitions of these functions (run.sh itself builds and measures when sourced)."""
    text = RUN_SH.read_text()
    found = []
    for name in names:
        match = re.search(rf"^{name}\(\) \{{.*?^\}}$", text, re.M | re.S)
        assert match, f"run.sh defines no {name}()"
        found.append(match.group(0))
    return "\n".join(found)


def test_run_sh_builds_the_newest_source_beside_the_pinned_one_with_the_same_flags() -> None:
    text = RUN_SH.read_text()
    build_tree = run_sh_functions("build_tree")
    # one function builds both, so the flags cannot drift apart; the newest adds only its build number and commit
    assert re.search(r'^build\(\) \{ WITH_SERVER="\$PINNED_SERVER" build_tree "\$CARRY/llama\.cpp\.tar\.gz" "\$SRC" '
                     r'"\$BUILD" ""; \}$', text, re.M)
    newest = run_sh_functions("build_newest")
    assert '"$CARRY/llama.cpp-newest.tar.gz" "$SRC_NEWEST" "$BUILD_NEWEST"' in newest
    assert "-DLLAMA_BUILD_NUMBER=" in newest and "-DLLAMA_BUILD_COMMIT=" in newest
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" in build_tree
    assert ('targets=(llama-bench llama-speculative-simple mtmd); [[ "${WITH_SERVER:-$BUILD_SERVER}" == 1 ]] '
            '&& targets+=(llama-server)') in build_tree
    assert 'BUILD_NEWEST="$WORK/build-newest"' in text and "run build-newest 200 build_newest" in text
    assert '--llama-bin "$YARDSTICK_BIN"' in text and '--llama-bin "$BIN"' not in text


def test_the_newest_builds_number_and_commit_come_from_the_manifest(tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    show = run_sh_functions("manifest") + '; echo "$(manifest newest-build 0) $(manifest newest-commit unknown)"'
    assert bash(show, tmp_path, CARRY=str(carry)).stdout.strip() == "0 unknown"  # no manifest: the defaults
    (carry / "MANIFEST.txt").write_text("sdist: x\nnewest-sdist: xllamacpp-1.tar.gz (sha256 ab)\nnewest-build: 11549\n"
                                        "newest-commit: 8f2c1a0\n")
    assert bash(show, tmp_path, CARRY=str(carry)).stdout.strip() == "11549 8f2c1a0"


def test_a_comparisons_time_counts_every_configuration_of_the_first_pass_and_the_finalists(tmp_path: Path) -> None:
    show = run_sh_functions("n_lengths", "against_need") + (
        '; for l in "" 2-6 2,4,6 3 "2-3,6"; do printf "%s " "$(n_lengths "$l")"; done; echo; '
        'echo "$(against_need 0 3) $(against_need 0.7 3)"; AGAINST_LENGTHS=3; echo "$(against_need 0.7 5)"')
    r = bash(show, tmp_path)
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["5", "5", "3", "1", "3"], r.stdout + r.stderr
    # T = 0: 5 lengths x host/backend = 10 configurations; T = 0.7: x 2 draft sampling modes = 20
    assert lines[1].split() == [str(20 + 12 * 3 + 5 * 3 * 10 + 5 * 3 * 2 * 3),
                                str(20 + 12 * 3 + 5 * 3 * 20 + 5 * 3 * 2 * 3)]
    assert lines[2] == str(20 + 12 * 5 + 5 * 3 * 4 + 5 * 3 * 2 * 5)  # one length: 4 configurations


def test_make_archive_packs_the_newest_source_pinned_by_its_sha256() -> None:
    text = (ROOT / "bench" / "gpu" / "make_archive.sh").read_text()
    sha = re.search(r"^NEWEST_SHA256=([0-9a-f]{64})$", text, re.M)
    assert sha and re.search(r"^NEWEST_BUILD=11549$", text, re.M) and re.search(r"^NEWEST_VERSION=2026\.10\.11549$",
                                                                                  text, re.M)
    # fetched by PyPI's JSON URL and checked against the pin; both sources trimmed by the same function
    assert "https://pypi.org/pypi/{package}/json" in text and "digest.hexdigest() != sha256" in text
    assert 'pack_llama "$SRC/vendor" "$CARRY/llama.cpp.tar.gz"' in text
    assert 'pack_llama "$NEWEST_SRC" "$CARRY/llama.cpp-newest.tar.gz"' in text
    assert '"--spec-draft-sampling"' in text  # a source without the option is refused
    for line in ("newest-sdist: ", "newest-build: ", "newest-commit: "):
        assert f'echo "{line}' in text


def test_no_gpu_script_names_a_variable_run_sh_reads_for_something_else() -> None:
    """run.sh takes JOBS from the environment as the build's -j: a script that named its job list JOBS built with
    `-j 'projector hybrid-mtp ...'` and stopped in 7 s on the GPU machine (grid.sh's, now GRID_JOBS)."""
    for script in gpu_scripts():
        if script.name != "run.sh":
            assert not re.search(r"(?<![A-Z_])JOBS=", script.read_text()), f"{script.name} sets JOBS"


@pytest.mark.slow
def test_grid_sh_measures_a_job_once_and_skips_it_when_its_csv_is_there(tmp_path: Path) -> None:
    """A CPU dry run of grid.sh (this machine's llama_cpp, the tiny hybrid): its one-client MTP cell's CSV is
    written with the row grid.py read; a second call finds it and measures nothing."""
    import os
    import sys

    work = tmp_path / "work"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "CARRIED_PY": "0",
           "HYBRID_SIZE": "hybrid-tiny", "CARD_SIZE": "card-tiny", "VOCAB": "", "LENGTHS": "16", "REPEAT": "1",
           "THREADS": "1", "HYBRID_CLASSES": "prose", "HYBRID_SWEEP": "2", "GRID_JOBS": "hybrid-mtp",
           "WORK": str(work), "BUDGET_S": "600", "LOCALSPEC_HOME": str(tmp_path / "home")}
    script = ROOT / "bench" / "gpu" / "grid.sh"
    first = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "all jobs done" in first.stdout, first.stdout
    [csv] = (work / "results" / "grid").glob("*-grid-hybrid-mtp.csv")
    rows = [line for line in csv.read_text().splitlines() if line.startswith("mtp,prose,16,1,")]
    assert len(rows) == 1 and (work / "out" / "grid-results.tar.gz").is_file()
    again = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "hybrid-mtp: done earlier" in again.stdout, again.stdout
    assert "START grid-hybrid-mtp" not in again.stdout
