"""Structured output and logprobs on the wire: `response_format` / `grammar` → a `Constraint`, and OpenAI's
logprobs shapes for chat (`choices[].logprobs.content`) and completions (`tokens`, `token_logprobs`, ...).

`response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (any JSON object; llama-server's optional
`schema` inside it is honoured), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (the schema
is always enforced, `strict` or not: a grammar cannot half-hold). `grammar` is llama-server's request field: GBNF
text. Logprobs are the target's full distribution at temperature 1 (OpenAI's meaning), drafted tokens included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localspec.errors import GrammarError
from localspec.rounds.constraints import Constraint
from localspec.server.errors import ApiError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One returned token's logprob entry: its text and bytes, and the best alternatives (text, bytes, logprob)."""

    text: str
    raw: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...]


def request_constraint(response_format: Any, grammar: Any) -> Constraint | None:
    """The request's constraint, or None; a 400 naming the field when it cannot be one."""
    if grammar is not None and response_format not in (None, {"type": "text"}):
        raise ApiError(400, "grammar and response_format: give one of them", param="grammar", code="invalid_value")
    try:
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise ApiError(400, "grammar: expected GBNF text", param="grammar", code="invalid_value")
            return Constraint(grammar, "grammar")
        return _response_format(response_format)
    except GrammarError as exc:
        param = "grammar" if grammar is not None else "response_format"
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, 'response_format: expected {"type": "text" | "json_object" | "json_schema", ...}',
                       param="response_format", code="invalid_value")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema", "schema"}
    if extra:
        raise ApiError(400, f"response_format: unknown field {sorted(extra)[0]!r}", param="response_format",
                       code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama-server's extension
        if schema is not None:
            return Constraint.json_schema(schema, "response_format.schema")
        return Constraint.json_object("response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, 'response_format.json_schema: expected {"name": ..., "schema": {...}}',
                           param="response_format.json_schema", code="invalid_value")
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise ApiError(400, f"response_format.json_schema: unknown field {sorted(unknown)[0]!r}",
                           param="response_format.json_schema", code="unknown_parameter")
        # No schema: any JSON value would do; OpenAI requires one, so the object grammar is the closest reading.
        schema = spec.get("schema")
        if schema is None:
            return Constraint.json_object("response_format.json_schema")
        return Constraint.json_schema(schema, "response_format.json_schema.schema")
    raise ApiError(400, f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                   param="response_format.type", code="invalid_value")


def chat_logprobs(logprobs: Any, top_logprobs: Any) -> int | None:
    """Chat's `logprobs: true` + `top_logprobs: N` → N alternatives per token (None: off)."""
    if logprobs is not None and type(logprobs) is not bool:
        raise ApiError(400, "logprobs: expected true or false", param="logprobs", code="invalid_value")
    if top_logprobs is not None and (type(top_logprobs) is not int or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"top_logprobs: expected an integer 0..{MAX_TOP_LOGPROBS}", param="top_logprobs",
                       code="invalid_value")
    if not logprobs:
        if top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return None
    return top_logprobs or 0


def completion_logprobs(logprobs: Any) -> int | None:
    """Completions' `logprobs: N` (0..5): the token's logprob and N alternatives (None: off)."""
    if logprobs is None:
        return None
    if type(logprobs) is not int or not 0 <= logprobs <= 5:
        raise ApiError(400, "logprobs: expected an integer 0..5", param="logprobs", code="invalid_value")
    return logprobs


def chat_shape(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(text: str, raw: bytes, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.text, e.raw, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
                        for e in entries], "refusal": None}


def completion_shape(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """`text_offset` counts characters from `offset` (the text already sent before these tokens)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t[0]: t[2] for t in e.top} for e in entries], "text_offset": offsets}
