"""Can this draft speculate for this target? A verdict from the two GGUF headers alone (no weights).

Speculation passes token ids, not text: the target tokenizes the prompt once, the draft proposes ids, the
target verifies them. So what must agree is what an id *means* (its text, and the special ids both models act
on, such as BOS), not how text is cut into ids. Each finding says why it breaks speculation or only warns:

- incompatible: different tokenizer model, vocab sizes more than 128 apart, a token text that differs at an
  id, BOS/add_bos (or add_eos/EOS) that differ: the draft would read a different sequence than the target.
- warning: token types, merges, pre-tokenizer, EOS/EOT ids, chat template: they change how text becomes ids
  or how special ids are shown, which the target decides alone; a mismatch can only lower acceptance, never
  the output.
- info: up to 128 trailing padding ids (tolerated, as llama.cpp does), PAD id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localspec.models.gguf_header import GGUFHeader, read_header
from localspec.status import Status

VOCAB_PAD_TOLERANCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
DRAFT_MAX_FRACTION = 0.10  # a draft above ~10% of the target eats the speedup it buys
EIGHT_BIT_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q8_1", "Q8_K"}
INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS", "MXFP4", "Q4_0_4_4", "Q4_0_4_8"}


@dataclass(frozen=True)
class Finding:
    level: Status
    field: str
    message: str  # what differs, with both values
    why: str  # why this breaks speculation, or why it only warns


QUANT_FIELDS = frozenset({"draft quantization", "draft size", "target quantization"})  # quant_advice's findings


@dataclass(frozen=True)
class Verdict:
    target: str
    draft: str
    findings: tuple[Finding, ...]

    @property
    def token_findings(self) -> tuple[Finding, ...]:
        """What the tokenizer comparison found (quantization advice left out)."""
        return tuple(f for f in self.findings if f.field not in QUANT_FIELDS)

    @property
    def tokens_match(self) -> bool:
        """Every id means the same token in both, with nothing that even lowers acceptance."""
        return all(f.level <= Status.INFO for f in self.token_findings)

    @property
    def level(self) -> Status:
        return max((f.level for f in self.findings), default=Status.OK)

    @property
    def compatible(self) -> bool:
        return self.level < Status.FAIL

    @property
    def label(self) -> str:
        if self.level == Status.FAIL:
            return "incompatible"
        return "compatible with warnings" if self.level == Status.WARN else "compatible"

    @property
    def reason(self) -> str:
        """The first blocking finding, as one line (what `IncompatiblePairError` says)."""
        fails = [f for f in self.findings if f.level == Status.FAIL]
        if not fails:
            return ""
        return f"{self.draft} cannot draft for {self.target}: {fails[0].message}"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "…"


def _scalar_field(
    findings: list[Finding], t: GGUFHeader, d: GGUFHeader, key: str, label: str, level: Status, why: str
) -> None:
    a, b = t.get(key), d.get(key)
    if a == b:
        return
    # Unset on one side only: llama.cpp fills a default per tokenizer, which we cannot see from the header.
    if (a is None) != (b is None) and level == Status.FAIL:
        level = Status.WARN
        why = "set in one file only, so llama.cpp's default applies to the other; " + why
    findings.append(Finding(level, label, f"{label} differs: target {_show(a)}, draft {_show(b)}", why))


def _compare_tokens(t: GGUFHeader, d: GGUFHeader) -> list[Finding]:
    out: list[Finding] = []
    ta, da = t.tokens, d.tokens
    if not ta or not da:
        missing = "target" if not ta else "draft"
        out.append(
            Finding(
                Status.FAIL,
                "tokens",
                f"the {missing} has no tokenizer.ggml.tokens",
                "without a vocabulary the ids cannot be matched",
            )
        )
        return out
    diff = abs(len(ta) - len(da))
    if diff > VOCAB_PAD_TOLERANCE:
        out.append(
            Finding(
                Status.FAIL,
                "vocab size",
                f"vocab sizes differ by {diff}: target {len(ta)}, draft {len(da)}",
                f"more than {VOCAB_PAD_TOLERANCE} extra ids is a different vocabulary, not padding",
            )
        )
        return out
    shared = min(len(ta), len(da))
    i = ta.first_difference(da)
    if i is not None:
        out.append(
            Finding(
                Status.FAIL,
                "token text",
                f"token id {i} differs: target {ta[i]!r}, draft {da[i]!r}",
                "the draft proposes ids, so an id with another text is another token to the target",
            )
        )
        return out
    if diff:
        longer = ta if len(ta) > len(da) else da
        out.append(
            Finding(
                Status.INFO,
                "vocab size",
                f"vocab sizes differ by {diff} trailing ids ({len(ta)} vs {len(da)}, "
                f"first extra {longer[shared]!r})",
                f"up to {VOCAB_PAD_TOLERANCE} trailing padding ids are tolerated, as llama.cpp does; "
                "they are never proposed",
            )
        )
    tt, dt = t.get("tokenizer.ggml.token_type"), d.get("tokenizer.ggml.token_type")
    if tt is not None and dt is not None:
        n = min(len(tt), len(dt), shared)
        bad = np.flatnonzero(np.asarray(tt[:n]) != np.asarray(dt[:n]))
        if bad.size:
            i = int(bad[0])
            out.append(
                Finding(
                    Status.WARN,
                    "token types",
                    f"{bad.size} token types differ, first id {i} ({ta[i]!r}): "
                    f"target {int(tt[i])}, draft {int(dt[i])}",
                    "types decide which ids are special in text; the target tokenizes and shows text alone",
                )
            )
    tm, dm = t.get("tokenizer.ggml.merges"), d.get("tokenizer.ggml.merges")
    if tm != dm:
        if tm is None or dm is None:
            msg = f"merges present in the {'target' if tm is not None else 'draft'} only"
        else:
            n = min(len(tm), len(dm))
            first = tm.first_difference(dm)
            i = n if first is None else first
            msg = (
                f"merge {i} differs: target {tm[i]!r}, draft {dm[i]!r}"
                if i < n
                else f"merge counts differ: target {len(tm)}, draft {len(dm)}"
            )
        out.append(
            Finding(
                Status.WARN,
                "merges",
                msg,
                "merges only decide how text becomes ids; localspec tokenizes with the target alone",
            )
        )
    return out


def _scalar_rules(target: GGUFHeader, draft: GGUFHeader) -> list[tuple[str, str, Status, str]]:
    """(key, label, level when the two files differ, why) for each special id and flag both models act on.

    BOS and EOS ids only break speculation when a model adds them to every prompt; otherwise a mismatch warns.
    """
    t_bos, d_bos = target.get("tokenizer.ggml.add_bos_token"), draft.get("tokenizer.ggml.add_bos_token")
    bos_added = bool(t_bos or d_bos or t_bos is None or d_bos is None)
    eos_added = bool(target.get("tokenizer.ggml.add_eos_token") or draft.get("tokenizer.ggml.add_eos_token"))
    ends = "the target decides when {} ends; the draft may only propose past it"
    return [
        ("tokenizer.ggml.add_bos_token", "add_bos", Status.FAIL,
         "the draft would see a sequence with (or without) a BOS the target does not have"),
        ("tokenizer.ggml.bos_token_id", "BOS id", Status.FAIL if bos_added else Status.WARN,
         "every prompt starts with the target's BOS id, which the draft would read as another token" if bos_added
         else "neither model adds a BOS, so only a template that writes one is affected"),
        ("tokenizer.ggml.add_eos_token", "add_eos", Status.FAIL,
         "the draft would see an EOS the target does not append"),
        ("tokenizer.ggml.eos_token_id", "EOS id", Status.FAIL if eos_added else Status.WARN,
         "appended to every prompt, so both must mean the same token" if eos_added else ends.format("generation")),
        ("tokenizer.ggml.eot_token_id", "EOT id", Status.WARN, ends.format("a turn")),
        ("tokenizer.ggml.padding_token_id", "PAD id", Status.INFO,
         "padding is never generated in a single-sequence run"),
        ("tokenizer.ggml.pre", "pre-tokenizer", Status.WARN,
         "the pre-tokenizer only splits text before tokenizing, which the target does alone"),
    ]


def compare(target: GGUFHeader, draft: GGUFHeader) -> Verdict:
    """Tokenizer compatibility plus quantization advice for one target/draft pair."""
    findings: list[Finding] = []
    tm, dm = target.get("tokenizer.ggml.model"), draft.get("tokenizer.ggml.model")
    if tm != dm:
        findings.append(Finding(Status.FAIL, "tokenizer model", f"tokenizer models differ: target {_show(tm)}, "
                                f"draft {_show(dm)}", "a different tokenizer model numbers its tokens differently"))
    else:
        findings.extend(_compare_tokens(target, draft))
    for key, label, level, why in _scalar_rules(target, draft):
        _scalar_field(findings, target, draft, key, label, level, why)
    tc, dc = target.get("tokenizer.chat_template"), draft.get("tokenizer.chat_template")
    if tc != dc:
        missing = " (one file has none)" if None in (tc, dc) else ""
        findings.append(Finding(Status.WARN, "chat template", f"chat templates differ{missing}",
                                "the target's template formats the prompt; a draft tuned on another format agrees "
                                "less often"))
    findings.extend(_compare_fim(target, draft))
    findings.extend(quant_advice(target, draft))
    return Verdict(target=target.name, draft=draft.name, findings=tuple(findings))


# The token texts llama.cpp's vocabulary loader takes for FIM tokens when the GGUF names none (llama-vocab.cpp).
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
}


def fim_ids(header: GGUFHeader) -> dict[str, int | None]:
    """The fill-in-the-middle token ids llama.cpp will use: the GGUF's own keys, else the first token whose text
    it recognizes."""
    found: dict[str, int | None] = {
        part: header.get(f"tokenizer.ggml.fim_{part}_token_id") for part in _FIM_TEXTS}
    for part, texts in _FIM_TEXTS.items():
        if found[part] is None:
            hits = [i for i in map(header.tokens.first_index, texts) if i is not None]
            found[part] = min(hits, default=None)
    return found


def _compare_fim(target: GGUFHeader, draft: GGUFHeader) -> list[Finding]:
    """Fill-in-the-middle (/infill, `suffix`) needs the target's FIM tokens; the draft should know them too."""
    t = fim_ids(target)
    if None in t.values():
        return []  # the server answers FIM requests with a 400 naming the missing tokens
    d = fim_ids(draft)
    ids = ", ".join(f"{part} {t[part]}" for part in t)
    if d == t:
        return [Finding(Status.INFO, "FIM tokens", f"fill-in-the-middle: both models have the FIM tokens ({ids})",
                        "the server's /infill and `suffix` prompts keep speculating")]
    return [Finding(Status.WARN, "FIM tokens", f"fill-in-the-middle: the target's FIM tokens ({ids}) are "
                    f"not the draft's ({', '.join(f'{p} {d[p]}' for p in d)})",
                    "FIM prompts still run, losslessly, but a draft that does not read them as FIM markers "
                    "agrees less often")]


def quant_advice(target: GGUFHeader, draft: GGUFHeader) -> list[Finding]:
    """The seeds' quantization rules of thumb, as warnings."""
    out: list[Finding] = []
    dtype = draft.file_type
    if dtype not in EIGHT_BIT_TYPES and draft.bits_per_weight < 8.0:
        out.append(
            Finding(
                Status.WARN,
                "draft quantization",
                f"the draft is {dtype} ({draft.bits_per_weight:.1f} bits/weight), below 8-bit",
                "a draft below Q8_0 agrees with the target ~10 points less often; use its Q8_0 file",
            )
        )
    if target.tensor_bytes and draft.tensor_bytes > DRAFT_MAX_FRACTION * target.tensor_bytes:
        out.append(
            Finding(
                Status.WARN,
                "draft size",
                f"the draft's weights are {draft.tensor_bytes / target.tensor_bytes:.0%} of the target's",
                f"above ~{DRAFT_MAX_FRACTION:.0%} a draft token costs too much of a target step to pay off",
            )
        )
    ttype = target.file_type
    if ttype not in INT4_TYPES and target.main_weight_type not in INT4_TYPES:
        out.append(
            Finding(
                Status.WARN,
                "target quantization",
                f"the target is {ttype} ({target.bits_per_weight:.1f} bits/weight), not int4-class",
                "the 24 GB recipe needs a ~4-bit target (Q4_K_M, Q4_0, IQ4_XS) to leave room for KV",
            )
        )
    return out


def check_files(target: Path, draft: Path) -> Verdict:
    return compare(read_header(target), read_header(draft))
