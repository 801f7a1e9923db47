"""A stand-in for llama.cpp's `llama-speculative-simple` (beside the real one: tests/test_versus.py runs that too
when a build is there): the same command-line surface that localspec.sessions.versus uses, its stdout (the prompt,
then the generated text, then a blank line) and its end-of-run timing lines on stderr, in the format the real tool
prints (tests/data/llama-speculative-simple/ holds a recorded run). It appends each command line it ran to a JSON-lines
log, so a test can check what localspec asked of it.

Its environment sets what it is and how fast it runs: STANDIN_DRAFT_SAMPLING=1 makes it a newer llama.cpp with
--spec-draft-sampling (else the option is an error, as in a build that predates it); STANDIN_VERSION its --version
line; a run's decode seconds are STANDIN_SECONDS times each factor of STANDIN_FACTORS (JSON: "k=N", "greedy",
"probabilistic", "backend" -> factor) that names its configuration, and from its STANDIN_AFTER-th call on (counting
from 0, the log's lines) each of STANDIN_LATER_FACTORS too, so a configuration can be fast in a first pass and slow
in the repeats that follow. STANDIN_PROBABILISTIC_ACCEPT: what a run with a probabilistic draft accepts of its 60
drafts (unset: 45, as a greedy draft's: the option changes nothing, as in llama.cpp b11549's tool)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT = r'''
import json, os, sys

USAGE = """----- common params -----
-m,    --model FNAME            model path
-f,    --file FNAME             a file containing the prompt (default: none)
-bs,   --backend-sampling       enable backend sampling (experimental) (default: disabled)
----- example-specific params -----
--spec-type [none|draft-simple|draft-eagle3|draft-mtp|ngram-simple]
--spec-draft-n-max, --draft-max N
"""
DRAFT_SAMPLING = """--spec-draft-sampling {greedy,probabilistic}
                        how the draft is sampled (default: greedy)
"""
newer = os.environ.get("STANDIN_DRAFT_SAMPLING") == "1"
args = sys.argv[1:]
if "--help" in args:
    print(os.environ.get("STANDIN_USAGE", USAGE + (DRAFT_SAMPLING if newer else "")))
    sys.exit(0)
if "--version" in args:
    print(os.environ.get("STANDIN_VERSION", "version: 4242 (standin)") + "\nbuilt with cc for x86_64-linux-gnu",
          file=sys.stderr)
    sys.exit(0)
opts = {}
i = 0
while i < len(args):
    if args[i].startswith("-") and i + 1 < len(args) and not args[i + 1].startswith("--"):
        opts[args[i]] = args[i + 1]
        i += 2
    else:
        opts[args[i]] = True
        i += 1
log_path = os.environ["STANDIN_LOG"]
call = sum(1 for _ in open(log_path)) if os.path.exists(log_path) else 0
with open(log_path, "a") as log:
    log.write(json.dumps(args) + "\n")
if "--spec-draft-sampling" in opts and not newer:
    print("error: invalid argument: --spec-draft-sampling", file=sys.stderr)
    sys.exit(1)
if os.environ.get("STANDIN_FAIL"):
    print("main: error: " + os.environ["STANDIN_FAIL"], file=sys.stderr)
    sys.exit(1)
with open(opts["-f"], encoding="utf-8") as fh:
    prompt = fh.read()
if prompt.endswith("\n"):
    prompt = prompt[:-1]  # as llama.cpp's -f does
reply = json.loads(os.environ.get("STANDIN_REPLIES", "{}")).get(prompt, " and so on")
n = int(opts["-n"])
seconds = float(os.environ.get("STANDIN_SECONDS", "0.5"))
if "--backend-sampling" in opts:
    seconds *= float(os.environ.get("STANDIN_BACKEND_FACTOR", "1.0"))
names = {"k=" + opts["--spec-draft-n-max"], opts.get("--spec-draft-sampling", "greedy")}
names |= {"backend"} if "--backend-sampling" in opts else set()
factors = dict(json.loads(os.environ.get("STANDIN_FACTORS", "{}")))
if call >= int(os.environ.get("STANDIN_AFTER", "1000000")):
    for name, factor in json.loads(os.environ.get("STANDIN_LATER_FACTORS", "{}")).items():
        factors[name] = factors.get(name, 1.0) * factor
for name in names:
    seconds *= factors.get(name, 1.0)
accepted = 45
if opts.get("--spec-draft-sampling") == "probabilistic":  # (unset: the option changes nothing, as in b11549's tool)
    accepted = int(os.environ.get("STANDIN_PROBABILISTIC_ACCEPT", accepted))
tokens = os.environ.get("STANDIN_PROMPT_TOKENS")
prompt_tokens = int(tokens) if tokens else len(prompt.split())
sys.stdout.write("\n\n" + prompt + reply + "\n\n\n\n")
sys.stderr.write(
    "\n\n0.00.514.274 I encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s\n"
    % (prompt_tokens, 0.05, prompt_tokens / 0.05)
    + "decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s\n" % (n + 1, seconds, (n + 1) / seconds)
    + "\nn_draft   = %s\nn_predict = %d\nn_drafted = %d\nn_accept  = %d\naccept    = %.3f%%\n"
    % (opts["--spec-draft-n-max"], n + 1, 60, accepted, 100.0 * accepted / 60)
    + "\ndraft:\n\nllama_perf_context_print:        load time =      12.34 ms\n"
)
'''


def write_tool(folder: Path, name: str = "llama-speculative-simple") -> Path:
    """An executable stand-in in `folder`; set STANDIN_LOG (the command lines it ran) in its environment."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    path.chmod(0o755)
    return path


def commands(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
