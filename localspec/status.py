"""The one status vocabulary: every check (tokenizer verdicts, doctor's checklist) reports one of these."""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """Ordered by severity, so the worst of several findings is their max()."""

    OK = 0
    INFO = 1
    WARN = 2
    FAIL = 3
