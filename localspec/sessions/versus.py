"""`localspec bench --against llama.cpp`: llama.cpp's own speculative loop, `llama-speculative-simple`, on the same
model files, prompt tokens, token count and sampling as the bench that just ran, in its fastest configuration, as
data: its runs, their medians, the ratio to localspec's speculative median, and where its greedy text leaves plain
decoding's.

llama-speculative-simple decodes one prompt per process (a model load each time; its decode timer starts after the
load and the prompt), prints the prompt and the generated text on stdout and its timings on stderr. It has no chat
template, so each prompt is written as the text localspec's target reads, with one extra trailing newline because
its `-f` drops one, and the prompt tokens it reports are checked against localspec's.

It runs in every configuration it has, and the fastest is the comparison: each draft length of
`bench.against_lengths` (llama.cpp's own default is 3), at T > 0 each of its draft sampling modes where it has
`--spec-draft-sampling` (greedy: the draft's argmax, accepted where the target's sample matches; probabilistic: the
draft sampled, rejection sampling on the target), and on a GPU its sampling on the host and with
`--backend-sampling`. Every run loads the models again, so the search has two stages: one repetition of every
configuration over the prompts, then the bench's full repeats of the two fastest, alternating; the faster
finalist's median is the comparison. A repetition's tok/s is all its prompts' tokens over all their decode seconds,
the same measure as a bench run.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localspec.config import DRAFTER_TABLE, parse_draft_lengths
from localspec.drafters import LLAMA_SERVER_TYPES
from localspec.errors import LocalspecError, UsageError
from localspec.sessions.bench import RunDone

if TYPE_CHECKING:
    from localspec.config import Preset
    from localspec.sessions.bench import BenchPrompt, BenchReport
    from localspec.sessions.session import Session

LLAMA_CPP = "llama.cpp"  # `--against`'s one choice besides none
TOOL = "llama-speculative-simple"
BIN_ENV = "LOCALSPEC_LLAMA_BIN"  # where to look when neither --llama-bin nor the preset's bench.llama_bin says
HOST, BACKEND = "host", "backend"  # llama.cpp's sampling: on the CPU after each decode, or in the device graph
# How its draft is sampled (`--spec-draft-sampling`, in llama.cpp since b11368 or so): its argmax, the target's sample
# accepted where it matches; or sampled, the target verifying by rejection sampling. A build without the option
# drafts greedily. A build may take the option in this tool and still match samples (b11549 verifies by rejection in
# llama-server only): `probabilistic_changed` checks each comparison's runs, and the report says so.
DRAFT_SAMPLING_FLAG = "--spec-draft-sampling"
GREEDY_DRAFT, PROBABILISTIC_DRAFT = "greedy", "probabilistic"
FINALISTS = 2  # configurations the first pass keeps for the full repeats
INSTALL = (f"build llama.cpp's {TOOL} (cmake -B build && cmake --build build --target {TOOL}) and pass "
           f"--llama-bin build/bin, set {BIN_ENV}, or put it on PATH")
PROBE_TIMEOUT_S = 60
# The `--spec-type`s of llama.cpp's tool that run as a localspec drafter does (the draft model's loop, the target's
# own MTP head, the drafters that read the target's layers: DFlash, DSpark, EAGLE-3, each its GGUF as -md), by the
# drafter that declares that type (its LLAMA_SERVER_TYPE). At T > 0 llama.cpp's loops for the last three sample and
# match whatever --spec-draft-sampling says (common/speculative.cpp: its probabilistic acceptance covers draft-simple
# and draft-mtp); localspec verifies them by rejection sampling.
TOOL_SPEC_TYPES = ("draft-simple", "draft-mtp", "draft-dflash", "draft-dspark", "draft-eagle3")
SPEC_TYPES = {name: spec for spec, name in LLAMA_SERVER_TYPES.items() if spec in TOOL_SPEC_TYPES}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VERSION = re.compile(r"version:\s*(\d+)\s*\(([^)]*)\)")
_TIMINGS = {
    "encoded": re.compile(r"encoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds"),
    "decoded": re.compile(r"decoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds"),
    # (this llama.cpp prefixes its log lines with a timestamp and a level: "0.00.514.348 I n_drafted = 54")
    "n_drafted": re.compile(r"\bn_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"\bn_accept\s*=\s*(\d+)"),
}


@dataclass(frozen=True)
class Timings:
    """What one run of the tool reports at its end."""

    prompt_tokens: int  # "encoded N tokens": the prompt as it tokenized it
    tokens: int  # "decoded N tokens in S seconds": generated tokens (it may overshoot -n by a round)
    seconds: float
    drafted: int
    accepted: int


def parse_timings(log: str) -> Timings | None:
    """The summary llama-speculative-simple prints on stderr when it finishes; None when it did not get there.
    Colour codes and log prefixes are ignored; the last of each line counts."""
    text = _ANSI.sub("", log)
    found = {key: pattern.findall(text) for key, pattern in _TIMINGS.items()}
    if not all(found.values()):
        return None
    encoded, decoded = found["encoded"][-1], found["decoded"][-1]
    return Timings(prompt_tokens=int(encoded[0]), tokens=int(decoded[0]), seconds=float(decoded[1]),
                   drafted=int(found["n_drafted"][-1]), accepted=int(found["n_accept"][-1]))


def generated_text(stdout: str, prompt: str) -> str | None:
    """The tool's stdout is the prompt's pieces (a BOS piece first where the model has one), the generated text,
    then two blank lines (one before its timings, one at its end): the text after the prompt, or None when the
    prompt is not there."""
    at = stdout.find(prompt)
    if at < 0:
        return None
    text = stdout[at + len(prompt):]
    for trailer in ("\n\n\n\n", "\n\n"):
        if text.endswith(trailer):
            return text[: -len(trailer)]
    return text


def first_divergence(plain_text: str, token_ends: list[int], other: str) -> int | None:
    """Where `other` (another loop's greedy text) first leaves plain decoding's text, as the index of the plain token
    holding the first differing character; None when it does not (a longer `other` that starts with the plain text
    went on where plain decoding stopped)."""
    n = min(len(plain_text), len(other))
    first_char = next((i for i in range(n) if plain_text[i] != other[i]), None)
    if first_char is None and len(other) < len(plain_text):
        first_char = len(other)  # it stopped (end of generation) where plain decoding went on
    if first_char is None or not token_ends:
        return None
    return min(bisect.bisect_right(token_ends, first_char), len(token_ends) - 1)


# -- the tool ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    path: Path
    version: str  # its --version line ("version: 1 (abc123)"), or "" when it printed none
    backend_sampling: bool  # it has --backend-sampling
    draft_sampling: bool = False  # it has --spec-draft-sampling (greedy or probabilistic drafts)

    @property
    def build(self) -> tuple[int | None, str | None]:
        return version_build(self.version)


def version_build(version: str) -> tuple[int | None, str | None]:
    """The build number and commit a --version line names ("version: 11549 (8f2c1a0)"); None where unknown."""
    found = _VERSION.search(version)
    return (int(found.group(1)), found.group(2)) if found else (None, None)


def find_tool(given: str = "", env: dict[str, str] | None = None) -> Path:
    """llama-speculative-simple: `given` (the option or the preset's `bench.llama_bin`), else $LOCALSPEC_LLAMA_BIN,
    else PATH; each may name the program or the folder that holds it (a llama.cpp build's `build/bin`)."""
    env = os.environ if env is None else env
    for where, value in (("--llama-bin", given), (BIN_ENV, env.get(BIN_ENV, ""))):
        if not value.strip():
            continue
        path = Path(value.strip()).expanduser()
        program = path / TOOL if path.is_dir() else path
        if not program.is_file():
            raise UsageError(f"{where} {value}: no {TOOL} there; {INSTALL}")
        if not os.access(program, os.X_OK):
            raise UsageError(f"{where} {value}: {program} is not executable")
        return program
    found = shutil.which(TOOL, path=env.get("PATH"))
    if found is None:
        raise UsageError(f"--against {LLAMA_CPP} needs {TOOL}, and none was found on PATH: {INSTALL}")
    return Path(found)


def probe_tool(path: Path, spec_type: str = TOOL_SPEC_TYPES[0]) -> Tool:
    """Run it once with --help (cheap: no model) before minutes of measuring: a build that cannot start (missing
    libraries) or predates the draft flags or the `--spec-type` used here is refused now, in one line."""
    try:
        helped = subprocess.run([str(path), "--help"], capture_output=True, text=True, errors="replace",
                                timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        versioned = subprocess.run([str(path), "--version"], capture_output=True, text=True, errors="replace",
                                   timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{path}: does not run ({exc.__class__.__name__}: {exc})") from None
    usage = helped.stdout + helped.stderr
    if "--spec-draft-n-max" not in usage or spec_type not in usage:
        last = _last_line(usage) or f"exit {helped.returncode}"
        raise UsageError(f"{path}: not a {TOOL} with --spec-type {spec_type} and --spec-draft-n-max (an older "
                         f"llama.cpp, or not the tool: {last}); build a current llama.cpp")
    version = next((line.strip() for line in (versioned.stderr + versioned.stdout).splitlines()
                    if line.strip().startswith("version:")), "")
    return Tool(path=path, version=version, backend_sampling="--backend-sampling" in usage,
                draft_sampling=DRAFT_SAMPLING_FLAG in usage)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- the plan: what both sides run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaPrompt:
    name: str
    text: str  # what llama.cpp tokenizes (special tokens parsed, BOS added where the model wants one)
    tokens: int  # how many tokens localspec's target read for it


@dataclass(frozen=True)
class Config:
    """One way llama.cpp's loop can run: its draft length, how it samples the draft, where it samples."""

    n_draft: int
    draft_sampling: str | None  # GREEDY_DRAFT or PROBABILISTIC_DRAFT; None: a build without the option (greedy)
    mode: str  # HOST or BACKEND

    @property
    def label(self) -> str:
        """How the comparison names it, e.g. `k=4 probabilistic-draft backend` (the view adds " sampling")."""
        drafts = f" {self.draft_sampling}-draft" if self.draft_sampling else ""
        return f"k={self.n_draft}{drafts} {self.mode}"


@dataclass(frozen=True)
class Plan:
    tool: Tool
    target: Path
    draft: Path | None  # None: a drafter without a draft model (the MTP head)
    preset: Preset
    threads: int
    prompts: tuple[LlamaPrompt, ...]
    modes: tuple[str, ...]
    extra: tuple[str, ...] = ()  # more of the tool's options (bench/structured.py: --grammar-file)
    lengths: tuple[int, ...] = ()  # its draft lengths to try (): the preset's draft length
    draft_samplings: tuple[str | None, ...] = (None,)  # its draft sampling modes to try (None: leave the option out)

    @property
    def configs(self) -> tuple[Config, ...]:
        """Every (draft length, draft sampling, sampling mode) the tool runs here."""
        lengths = self.lengths or (self.preset.draft.n_draft,)
        return tuple(Config(n, ds, mode) for n in lengths for ds in self.draft_samplings for mode in self.modes)

    def command(self, prompt_file: Path, config: Config, rep: int = 0) -> list[str]:
        """The tool's command line for one prompt: the bench's files, context, threads and sampling (the seed of
        repetition `rep`, as localspec's runs of that repetition take: `Sampling.repetition`), and the
        configuration's draft length, draft sampling and sampling mode."""
        s, d, load = self.preset.sampling.repetition(rep), self.preset.draft, self.preset.load
        layers = lambda n: "all" if n < 0 else str(n)  # noqa: E731 -- localspec's -1 is llama.cpp's "all"
        cmd = [str(self.tool.path), "-m", str(self.target), "-ngl", layers(load.n_gpu_layers),
               "-c", str(load.n_ctx), "-b", str(load.n_ctx), "-ctk", load.kv_type, "-ctv", load.kv_type,
               "-t", str(self.threads)]
        if self.draft is not None:  # (the MTP head's context takes the target's settings)
            cmd += ["-md", str(self.draft), "-ngld", layers(load.draft_n_gpu_layers), "-ctkd", load.kv_type,
                    "-ctvd", load.kv_type, "-td", str(self.threads)]
        cmd += ["-fa", "auto", "-n", str(self.preset.bench.max_tokens), "-f", str(prompt_file),
               "--seed", str(s.seed), "--temp", f"{s.temperature:g}", "--top-k", str(s.top_k),
               "--top-p", f"{s.top_p:g}", "--min-p", f"{s.min_p:g}", "--repeat-penalty", f"{s.repeat_penalty:g}",
               "--repeat-last-n", str(s.repeat_last_n), "--presence-penalty", f"{s.presence_penalty:g}",
               "--frequency-penalty", f"{s.frequency_penalty:g}",
               "--spec-type", SPEC_TYPES[d.drafter], "--spec-draft-n-max", str(config.n_draft),
               "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{d.p_min:g}"]
        if config.draft_sampling is not None:
            cmd += [DRAFT_SAMPLING_FLAG, config.draft_sampling]
        if load.split_mode != "layer" or load.tensor_split or load.main_gpu:
            cmd += ["-sm", load.split_mode, "-mg", str(load.main_gpu)]
            cmd += ["-ts", load.tensor_split] if load.tensor_split else []
        if load.rpc:
            cmd += ["--rpc", load.rpc]
        if config.mode == BACKEND:
            cmd.append("--backend-sampling")
        return cmd + list(self.extra)


def draft_samplings(tool: Tool, temperature: float) -> tuple[str | None, ...]:
    """The tool's draft sampling modes worth comparing: both at T > 0 where it has the option; greedy at T = 0
    (both draft the argmax there); none named where it lacks the option (its draft is greedy)."""
    if not tool.draft_sampling:
        return (None,)
    return (GREEDY_DRAFT, PROBABILISTIC_DRAFT) if temperature > 0 else (GREEDY_DRAFT,)


def check_comparable(preset: Preset, has_draft_model: bool, sweep: bool) -> None:
    """What llama-speculative-simple cannot run alike is refused before anything loads."""
    if sweep:
        raise UsageError(f"--against {LLAMA_CPP} compares one draft length; leave out --sweep")
    drafter = preset.draft.drafter
    needs_model = DRAFTER_TABLE[drafter].needs_draft_model
    if drafter not in SPEC_TYPES or (needs_model and not has_draft_model):
        alike = " or ".join(f"--drafter {name} ({spec})" for name, spec in SPEC_TYPES.items())
        raise UsageError(f"--against {LLAMA_CPP} compares {TOOL}'s loops that run as {alike} do, not --drafter "
                         f"{drafter}" + (" without a draft model" if drafter in SPEC_TYPES else ""))
    if preset.draft.adaptive:
        raise UsageError(f"--against {LLAMA_CPP}: {TOOL} drafts a fixed length; leave out --adaptive")
    if preset.load.draft_device != "auto":
        raise UsageError(f"--against {LLAMA_CPP}: --draft-device {preset.load.draft_device} has no counterpart in "
                         f"{TOOL} here; compare with the default placement")


def plan(session: Session, preset: Preset, tool: Tool, prompts: list[BenchPrompt] | None, raw: bool) -> Plan:
    """The prompts as llama.cpp must read them to see localspec's tokens: the rendered text, without a BOS the
    template wrote where llama.cpp adds one itself; every draft length of `bench.against_lengths` and draft
    sampling mode the tool has."""
    from localspec.sessions.bench import render_prompts

    texts = [llama_prompt(session, name, text, tokens) for name, text, tokens in render_prompts(session, prompts, raw)]
    return dataclasses.replace(plan_for(session, preset, tool, texts),
                               lengths=parse_draft_lengths(preset.bench.against_lengths),
                               draft_samplings=draft_samplings(tool, preset.sampling.temperature))


def plan_for(session: Session, preset: Preset, tool: Tool, prompts: list[LlamaPrompt],
             extra: tuple[str, ...] = ()) -> Plan:
    """The tool's runs of `prompts` on the session's files, threads and devices at the preset's draft length:
    host sampling, and on a GPU device sampling too."""
    target = session.target
    uses_draft = session.draft is not None and DRAFTER_TABLE[preset.draft.drafter].needs_draft_model
    draft = session.draft.path if uses_draft else None
    return Plan(tool=tool, target=target.path, draft=draft, preset=preset, threads=target.n_threads,
                prompts=tuple(prompts), modes=(HOST, BACKEND) if target.on_gpu and tool.backend_sampling else (HOST,),
                extra=extra)


def llama_prompt(session: Session, name: str, text: str, tokens: list[int]) -> LlamaPrompt:
    """A prompt as llama.cpp must read it to see `tokens`: llama.cpp adds the BOS the model wants itself, so a BOS
    that a chat template wrote into `text` is left out."""
    target = session.target
    bos_text = target.piece(target.bos, special=True).decode("utf-8", "replace") if target.bos >= 0 else ""
    if target.add_bos and bos_text and tokens[:1] == [target.bos] and text.startswith(bos_text):
        text = text[len(bos_text):]
    return LlamaPrompt(name, text, len(tokens))


# -- running it ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaRun:
    prompt: str
    config: Config
    repetition: int
    timings: Timings
    text: str | None = field(repr=False)  # the generated text (None: the prompt was not found on stdout)

    @property
    def mode(self) -> str:
        """Its sampling mode (host or backend)."""
        return self.config.mode

    def as_dict(self) -> dict[str, Any]:
        t, c = self.timings, self.config
        return {"prompt": self.prompt, "mode": c.mode, "n_draft": c.n_draft, "draft_sampling": c.draft_sampling,
                "repetition": self.repetition, "prompt_tokens": t.prompt_tokens, "tokens": t.tokens,
                "seconds": t.seconds, "drafted": t.drafted, "accepted": t.accepted, "text": self.text}


@dataclass(frozen=True)
class ConfigResult:
    config: Config
    runs: int  # complete repetitions (every prompt once)
    median_tps: float
    min_tps: float
    max_tps: float
    acceptance_rate: float | None  # accepted over drafted, all runs (None: nothing drafted)

    @property
    def mode(self) -> str:
        """The configuration as the comparison names it (`k=3 greedy-draft host`)."""
        return self.config.label

    @classmethod
    def of(cls, config: Config, runs: list[LlamaRun], prompts: int) -> ConfigResult | None:
        by_rep: dict[int, list[LlamaRun]] = {}
        for run in runs:
            if run.config == config:
                by_rep.setdefault(run.repetition, []).append(run)
        complete = [rep for rep in by_rep.values() if len(rep) == prompts]
        tps = [sum(r.timings.tokens for r in rep) / s for rep in complete
               if (s := sum(r.timings.seconds for r in rep)) > 0]
        if not tps:
            return None
        drafted = sum(r.timings.drafted for rep in complete for r in rep)
        accepted = sum(r.timings.accepted for rep in complete for r in rep)
        return cls(config=config, runs=len(tps), median_tps=statistics.median(tps), min_tps=min(tps),
                   max_tps=max(tps), acceptance_rate=accepted / drafted if drafted else None)

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        return {"mode": c.mode, "n_draft": c.n_draft, "draft_sampling": c.draft_sampling, "label": c.label,
                "runs": self.runs, "median_tps": self.median_tps, "min_tps": self.min_tps, "max_tps": self.max_tps,
                "acceptance_rate": self.acceptance_rate}


@dataclass(frozen=True)
class GreedyMatch:
    """At temperature 0: where llama.cpp's greedy text of a prompt leaves localspec's plain decoding."""

    prompt: str
    mode: str  # the configuration, as ConfigResult.mode names it
    first_divergence: int | None  # the plain token where it first differs; None: the same text
    plain_margin: float | None  # plain decoding's top-1 minus top-2 logit there: how close the call was
    same_every_run: bool


@dataclass
class Comparison:
    tool: str
    version: str
    command: list[str]  # the best configuration's command line, PROMPT.txt for each prompt's file, for the record
    temperature: float
    modes: list[ConfigResult]  # the finalists' full repeats
    localspec_tps: float  # localspec's speculative median, same prompts
    runs: list[LlamaRun]  # the finalists' full repeats
    greedy: list[GreedyMatch]
    warnings: list[str]
    first_pass: list[ConfigResult] = field(default_factory=list)  # every configuration once ([]: no first pass)
    first_pass_runs: list[LlamaRun] = field(default_factory=list)
    lengths: tuple[int, ...] = ()
    draft_samplings: tuple[str | None, ...] = (None,)
    has_draft_sampling: bool = False  # the tool has --spec-draft-sampling (a probabilistic draft)
    probabilistic_changed: bool | None = None  # its probabilistic drafts ran otherwise than greedy ones (T > 0)

    @property
    def best(self) -> ConfigResult | None:
        return max(self.modes, key=lambda m: m.median_tps, default=None)

    @property
    def ratio(self) -> float | None:
        """localspec's speculative median over llama.cpp's faster finalist's."""
        best = self.best
        return self.localspec_tps / best.median_tps if best and best.median_tps else None

    def as_json(self) -> dict[str, Any]:
        best = self.best
        build, commit = version_build(self.version)
        return {"against": LLAMA_CPP, "tool": self.tool, "version": self.version, "build": build, "commit": commit,
                "command": self.command, "temperature": self.temperature,
                "search": {"lengths": list(self.lengths), "draft_sampling": list(self.draft_samplings),
                           "probabilistic_draft": self.has_draft_sampling,
                           "probabilistic_changed": self.probabilistic_changed,
                           "first_pass": [m.as_dict() for m in self.first_pass],
                           "finalists": [m.config.label for m in self.modes]},
                "modes": [m.as_dict() for m in self.modes],
                "best_mode": best.config.mode if best else None,
                "best": best.as_dict() if best else None, "localspec_tps": self.localspec_tps, "ratio": self.ratio,
                "greedy": [dataclasses.asdict(g) for g in self.greedy], "warnings": self.warnings,
                "runs": [r.as_dict() for r in self.runs],
                "first_pass_runs": [r.as_dict() for r in self.first_pass_runs]}


ModeResult = ConfigResult  # (its name before draft lengths and draft sampling joined the sampling mode)


def run_against(plan: Plan, report: BenchReport, repeat: int | None = None,
                timeout_s: float | None = None) -> Iterator[RunDone[LlamaRun] | Comparison]:
    """Every configuration once over the prompts (the first pass), then the bench's `repeat` repetitions of the
    FINALISTS fastest, alternating; then the comparison. With FINALISTS configurations or fewer there is no first
    pass: all of them run the full repeats. At T > 0 a probe comes first: one prompt with a greedy and a
    probabilistic draft; where the two ran alike, the probabilistic configurations are left out of the search.

    Run after localspec's session has closed: on a 24 GB card the two loops' models do not fit together."""
    if timeout_s is None:  # a generous multiple of what localspec's plain decoding took, plus loading
        slowest = max(report.plain.min_tps, 1e-3)
        timeout_s = 120.0 + 20.0 * plan.preset.bench.max_tokens / slowest
    repeat = repeat or plan.preset.bench.repeat
    configs, prompts = plan.configs, len(plan.prompts)
    first_runs: list[LlamaRun] = []
    runs: list[LlamaRun] = []
    with _prompt_files(plan) as files:
        def planned(searched: tuple[Config, ...]) -> int:  # the first pass's runs (if any) and the finalists'
            first = len(searched) * prompts if len(searched) > FINALISTS else 0
            return first + min(FINALISTS, len(searched)) * repeat * prompts

        probe = _sampling_probe(configs)
        if probe:
            # Does the tool's probabilistic draft change anything? One prompt, both draft samplings, one
            # configuration (repetition -1: no part of the first pass's medians). Where it ran alike, the
            # probabilistic configurations would repeat the greedy ones' runs: they leave the search, and the
            # comparison says why (`probabilistic_changed`).
            for i, config in enumerate(probe):
                first_runs.append(_one_run(plan.command(files[plan.prompts[0].name], config), plan.prompts[0],
                                           config, -1, timeout_s))
                yield RunDone(first_runs[-1], i + 1, len(probe) + planned(configs))
            if probabilistic_changed(first_runs) is False:
                configs = tuple(c for c in configs if c.draft_sampling != PROBABILISTIC_DRAFT)
        total = len(first_runs) + planned(configs)
        finalists = configs
        if len(configs) > FINALISTS:
            for done in _runs(plan, files, configs, 1, timeout_s, len(first_runs), total):
                first_runs.append(done.result)
                yield done
            ranked = sorted((r for c in configs if (r := ConfigResult.of(c, first_runs, prompts)) is not None),
                            key=lambda r: r.median_tps, reverse=True)
            finalists = tuple(r.config for r in ranked[:FINALISTS])
        for done in _runs(plan, files, finalists, repeat, timeout_s, len(first_runs), total):
            runs.append(done.result)
            yield done
    yield compare(plan, report, runs, first_runs)


def _sampling_probe(configs: tuple[Config, ...]) -> tuple[Config, ...]:
    """The pair of configurations that tells whether the tool's probabilistic draft changes anything: the first
    configuration with a greedy draft and its probabilistic twin; () where the search has no such pair (T = 0, a
    tool without the option)."""
    for config in configs:
        if config.draft_sampling == GREEDY_DRAFT:
            twin = dataclasses.replace(config, draft_sampling=PROBABILISTIC_DRAFT)
            if twin in configs:
                return config, twin
    return ()


def run_prompts(plan: Plan, repeat: int, timeout_s: float) -> Iterator[RunDone[LlamaRun]]:
    """Every prompt once per configuration and repetition, the configurations' order alternating between
    repetitions."""
    configs = plan.configs
    with _prompt_files(plan) as files:
        yield from _runs(plan, files, configs, repeat, timeout_s, 0, repeat * len(configs) * len(plan.prompts))


@contextmanager
def _prompt_files(plan: Plan) -> Iterator[dict[str, Path]]:
    """Each prompt in a file of its own for the tool's -f, for as long as the runs last."""
    with tempfile.TemporaryDirectory(prefix="localspec-llama-") as folder:
        files = {}
        for i, p in enumerate(plan.prompts):
            files[p.name] = Path(folder) / f"prompt-{i}.txt"
            files[p.name].write_text(p.text + "\n", encoding="utf-8")  # its -f drops one trailing newline
        yield files


def _runs(plan: Plan, files: dict[str, Path], configs: tuple[Config, ...], repeat: int, timeout_s: float,
          done: int, total: int) -> Iterator[RunDone[LlamaRun]]:
    """`repeat` repetitions of every prompt in each of `configs`, their order reversed every other repetition (so
    neither side of a pair always runs first); `done`: the runs already made, `total`: all of them."""
    for rep in range(repeat):
        for config in configs if rep % 2 == 0 else tuple(reversed(configs)):
            for p in plan.prompts:
                done += 1
                yield RunDone(_one_run(plan.command(files[p.name], config, rep), p, config, rep, timeout_s), done,
                              total)


def _one_run(cmd: list[str], prompt: LlamaPrompt, config: Config, rep: int, timeout_s: float) -> LlamaRun:
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LocalspecError(f"{TOOL} did not finish prompt {prompt.name!r} ({config.label} sampling) in "
                             f"{timeout_s:.0f} s; command: {' '.join(cmd)}") from None
    except OSError as exc:
        raise LocalspecError(f"{cmd[0]}: could not run it ({exc.strerror or exc})") from None
    stderr = done.stderr.decode("utf-8", "replace")
    timings = parse_timings(stderr)
    if done.returncode != 0 or timings is None:
        said = _last_line(stderr) or "no output"
        raise LocalspecError(f"{TOOL} failed on prompt {prompt.name!r} ({config.label} sampling, exit "
                             f"{done.returncode} after {time.perf_counter() - start:.0f} s): {said}")
    # The generated text, as written: \r\n stays (decoding the bytes, not a text-mode read).
    text = generated_text(done.stdout.decode("utf-8", "replace"), prompt.text)
    return LlamaRun(prompt.name, config, rep, timings, text)


def compare(plan: Plan, report: BenchReport, runs: list[LlamaRun],
            first_runs: list[LlamaRun] | None = None) -> Comparison:
    """The finalists' medians, the ratio, the prompt-token check and, at temperature 0, each finalist's greedy
    texts against plain decoding's (the bench's greedy check holds plain decoding's text); with the first pass's
    figures for the record."""
    first_runs = first_runs or []
    finalists = tuple(dict.fromkeys(r.config for r in runs))
    modes = [m for c in finalists if (m := ConfigResult.of(c, runs, len(plan.prompts))) is not None]
    first_pass = [m for c in plan.configs if (m := ConfigResult.of(c, first_runs, len(plan.prompts))) is not None]
    warnings = []
    for p in plan.prompts:
        seen = sorted({r.timings.prompt_tokens for r in runs + first_runs if r.prompt == p.name})
        if seen and seen != [p.tokens]:
            warnings.append(f"prompt {p.name!r}: {TOOL} read {', '.join(map(str, seen))} prompt tokens where "
                            f"localspec read {p.tokens}: the two did not decode the same prompt")
    temperature = plan.preset.sampling.temperature
    if temperature > 0 and not plan.tool.draft_sampling:
        warnings.append(f"this {TOOL} has no {DRAFT_SAMPLING_FLAG} (an older llama.cpp): its draft is greedy only, "
                        "no probabilistic draft was compared")
    changed = probabilistic_changed(first_runs + runs) if temperature > 0 else None
    if changed is False:
        probed = not any(r.config.draft_sampling == PROBABILISTIC_DRAFT and r.repetition >= 0
                         for r in first_runs + runs)
        warnings.append(f"{DRAFT_SAMPLING_FLAG} {PROBABILISTIC_DRAFT} changed nothing in this {TOOL}: each of its "
                        f"runs drafted, accepted and wrote what the same configuration's greedy draft did, so it "
                        f"matched the target's samples either way (llama.cpp b11549 gives its rejection sampling to "
                        f"llama-server only): this comparison at T = {temperature:g} is with sample-and-match"
                        + ("; the search then ran greedy drafts only" if probed else ""))
    greedy = []
    if temperature == 0:
        plain = {c.name: c for c in report.greedy_check.prompts}
        for config in finalists:
            for p in plan.prompts:
                texts = [r.text for r in runs if r.prompt == p.name and r.config == config and r.text is not None]
                check = plain.get(p.name)
                if not texts or check is None:
                    continue
                first = first_divergence(check.plain_text, check.plain_token_ends, texts[0])
                margin = check.plain_margins[first] if first is not None and first < len(check.plain_margins) \
                    else None
                greedy.append(GreedyMatch(p.name, config.label, first, margin, len(set(texts)) == 1))
    best = max(modes, key=lambda m: m.median_tps, default=None)
    shown = best.config if best else (finalists or plan.configs)[0]
    return Comparison(tool=str(plan.tool.path), version=plan.tool.version,
                      command=plan.command(Path("PROMPT.txt"), shown), temperature=temperature, modes=modes,
                      localspec_tps=report.speculative.median_tps, runs=runs, greedy=greedy, warnings=warnings,
                      first_pass=first_pass, first_pass_runs=first_runs, lengths=tuple(sorted({c.n_draft for c in
                      plan.configs})), draft_samplings=plan.draft_samplings,
                      has_draft_sampling=plan.tool.draft_sampling, probabilistic_changed=changed)


def probabilistic_changed(runs: list[LlamaRun]) -> bool | None:
    """Whether the tool's probabilistic drafts ran otherwise than its greedy ones: a run's text, drafted and accepted
    counts against the same prompt, length and sampling mode's with a greedy draft. None where no configuration ran
    both. A loop that verifies by sample-and-match whatever the option says gives the same run both ways (seeded)."""
    outcomes: dict[tuple[str, int, str, str | None], set[tuple[object, ...]]] = {}
    for run in runs:
        c, t = run.config, run.timings
        outcomes.setdefault((run.prompt, c.n_draft, c.mode, c.draft_sampling), set()).add(
            (run.text, t.tokens, t.drafted, t.accepted))
    pairs = [(seen, outcomes.get((prompt, k, mode, PROBABILISTIC_DRAFT)))
             for (prompt, k, mode, sampling), seen in outcomes.items() if sampling == GREEDY_DRAFT]
    pairs = [(greedy, probabilistic) for greedy, probabilistic in pairs if probabilistic]
    return any(greedy != probabilistic for greedy, probabilistic in pairs) if pairs else None
