"""The request bodies of /v1/chat/completions and /v1/completions, and what is refused.

Strict on purpose: an unknown field is a 400 naming it (a typo such as `temprature` must not fall back to the
preset silently), and so is a known OpenAI or llama-server field whose feature localspec does not have
(`logit_bias`, `functions`, `mirostat`, ...), unless its value asks for nothing (`functions: []`, `mirostat: 0`),
which front-ends send by default. llama-server's native fields that mean something here (`n_predict`, `id_slot`,
`speculative.n_max`, ...) are accepted beside OpenAI's. Tools, `response_format`, `grammar` and logprobs are
checked where they are used (server/tools.py, server/structured.py). Types are strict (`"0.5"` is not a
temperature) and every range comes from the preset's own metadata in `localspec.config`, so the server accepts
exactly what a preset may hold.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from localspec.config import DRAFTERS, key_metadata
from localspec.drafters import LLAMA_SERVER_TYPES
from localspec.llama.vision import MARKER
from localspec.server.errors import ApiError

MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_CHOICES = 64  # n per request (and never more than the server's slots + queue)
FIELD_OF_KEY = {"n_draft": "speculative.n_max", "p_min": "speculative.p_min",
                "drafter": "speculative.type"}  # preset key → request field
# speculative.type as llama-server spells it (common/speculative.cpp's names, each declared by its drafter; a chain as
# --spec-type's list) → what it means here: a drafter, or "none" (no drafting); every drafter also answers to its own
# name (`[draft] drafter`), so one added to the registry is a type at once.
SPECULATIVE_TYPES: dict[str, str | None] = {"none": None, **LLAMA_SERVER_TYPES, **{name: name for name in DRAFTERS}}


def speculative_name(drafter: str | None) -> str:
    """A drafter's `speculative.type` (llama-server's name where it has one; None: "none")."""
    return next(name for name, meant in SPECULATIVE_TYPES.items() if meant == drafter)


def _limits(key: str) -> dict[str, Any]:
    """The preset's allowed range for one key, as pydantic bounds."""
    lo, hi = key_metadata(key)["range"]
    return {"ge": lo, "le": hi}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


SpeculativeType = Literal[tuple(SPECULATIVE_TYPES)]  # type: ignore[valid-type]


class Speculative(_Strict):
    """llama.cpp's per-request draft settings: `n_max` is the draft length (0 = no drafting), `type` who drafts
    (`SPECULATIVE_TYPES`)."""

    n_max: int | None = Field(None, **_limits("n_draft"))
    p_min: float | None = Field(None, **_limits("p_min"))
    type: SpeculativeType | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == ok and type(v) is type(ok) for ok in values)


# field → (does this value ask for nothing?, why it is refused otherwise)
_COMMON_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_neutral(None, {}), "logit_bias is not supported (it would change the target's distribution)"),
}
# llama-server's native fields (tools/server/README.md, `/completion`) whose feature localspec does not have:
# accepted when they ask for nothing (llama.cpp front-ends send them all, at their defaults), else refused by name.
_NO_LOGPROBS = "llama-server's token probabilities are not supported here (OpenAI's logprobs are)"
_LLAMA_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n_probs": (_neutral(None, 0), _NO_LOGPROBS),
    "post_sampling_probs": (_neutral(None, False), _NO_LOGPROBS),
    "n_cache_reuse": (_neutral(None, 0), "KV shifting is not supported (a cached prefix is reused as it is)"),
    "n_indent": (_neutral(None, 0), "n_indent is not supported"),
    "ignore_eos": (_neutral(None, False), "ignore_eos is not supported"),
    "typical_p": (_neutral(None, 1, 1.0), "locally typical sampling is not supported"),
    "top_n_sigma": (_neutral(None, -1, -1.0, 0, 0.0), "top-n-sigma sampling is not supported"),
    "dynatemp_range": (_neutral(None, 0, 0.0), "dynamic temperature is not supported"),
    "xtc_probability": (_neutral(None, 0, 0.0), "XTC sampling is not supported"),
    "dry_multiplier": (_neutral(None, 0, 0.0), "DRY sampling is not supported"),
    "mirostat": (_neutral(None, 0), "Mirostat sampling is not supported"),
    "adaptive_target": (lambda v: v is None or (type(v) in (int, float) and v < 0),
                        "adaptive sampling is not supported"),
    "min_keep": (_neutral(None, 0), "min_keep is not supported"),
    "json_schema": (_neutral(None), "JSON schemas are not supported"),
    "samplers": (_neutral(None), "the sampler order is fixed: penalties, top_k, top_p, min_p, temperature"),
    "t_max_predict_ms": (_neutral(None, 0), "time limits are not supported"),
    "t_max_prompt_ms": (_neutral(None, 0, -1), "time limits are not supported"),
    "return_tokens": (_neutral(None, False), "return_tokens is not supported"),
    "return_progress": (_neutral(None, False), "prompt progress is not reported"),
    "response_fields": (_neutral(None, []), "response_fields is not supported"),
    "lora": (_neutral(None, []), "LoRA adapters are not supported"),
    "speculative.n_min": (_neutral(None, 0), "a minimum draft length is not supported (drafting stops below "
                                             "speculative.p_min)"),
    "speculative.ngram_size_n": (_neutral(None), "prompt lookup's n-gram sizes are not set per request"),
    "speculative.ngram_size_m": (_neutral(None), "prompt lookup's n-gram sizes are not set per request"),
    "speculative.ngram_min_hits": (_neutral(None), "prompt lookup's n-gram sizes are not set per request"),
}
# Settings of a sampler whose switch above is off: llama.cpp front-ends send them at their defaults. Any value is
# accepted and ignored (when the switch is on, the switch itself is refused).
_SWITCHED_OFF = ("dynatemp_exponent", "xtc_threshold", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                 "dry_sequence_breakers", "mirostat_tau", "mirostat_eta", "adaptive_decay", "backend_sampling")
_COMMON_UNSUPPORTED.update(_LLAMA_UNSUPPORTED)

_CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "functions": (_neutral(None, []), "function calling is not supported"),
    "function_call": (_neutral(None, "none", "auto"), "function calling is not supported"),
    "modalities": (_neutral(None, ["text"]), "only text output is supported"),
    "audio": (_neutral(None), "audio output is not supported"),
}
_COMPLETION_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "best_of": (_neutral(None, 1), "only best_of = 1 is supported"),
    "echo": (_neutral(None, False), "echo is not supported"),
}


class _Generation(_Strict):
    """Fields shared by both endpoints. Sampling fields overlay the server's preset; absent = the preset's."""

    model: str | None = None  # the served id or an alias (app.py answers any other with 404 model_not_found)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, **_limits("temperature"))
    top_k: int | None = Field(None, **_limits("top_k"))
    top_p: float | None = Field(None, **_limits("top_p"))
    min_p: float | None = Field(None, **_limits("min_p"))
    repeat_penalty: float | None = Field(None, **_limits("repeat_penalty"))
    repeat_last_n: int | None = Field(None, **_limits("repeat_last_n"))
    presence_penalty: float | None = Field(None, **_limits("presence_penalty"))
    frequency_penalty: float | None = Field(None, **_limits("frequency_penalty"))
    seed: int | None = Field(None, ge=-1, le=_limits("seed")["le"])  # -1: random (llama.cpp's meaning)
    stop: tuple[str, ...] = ()
    speculative: Speculative | None = None
    # llama-server's native fields (its flat `speculative.*` spelling is the canonical one; the nested object is
    # accepted too).
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", **_limits("n_draft"))
    speculative_p_min: float | None = Field(None, alias="speculative.p_min", **_limits("p_min"))
    speculative_type: SpeculativeType | None = Field(None, alias="speculative.type")
    n_predict: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)  # -1: no limit (llama.cpp's default)
    id_slot: int | None = Field(None, ge=-1)  # -1: any free slot
    cache_prompt: bool | None = None  # the cached prefix is always reused: here it changes no output bit
    timings_per_token: bool | None = None
    # Context shift (the server's --context-shift for this request; llama-server's n_keep and n_discard).
    context_shift: bool | None = None
    n_keep: int | None = Field(None, **_limits("n_keep"))
    n_discard: int | None = Field(None, **_limits("n_discard"))
    # Bookkeeping fields of the OpenAI API that change nothing about the generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices, each sampled with its own seed (seed + i)
    n_cmpl: int | None = Field(None, ge=1, le=MAX_CHOICES)  # llama-server's name for n
    # Known OpenAI fields this server refuses unless neutral: declared so `extra="forbid"` leaves them to
    # `parse`, which names them with a reason.
    logit_bias: Any = None
    # Structured output (checked by server/structured.py, which names the field): OpenAI's and llama-server's.
    response_format: Any = None
    grammar: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
            raise ValueError("expected a string or a list of strings")
        if len(values) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in values):
            raise ValueError("a stop string must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in values):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return tuple(values)

    @field_validator("n_predict")
    @classmethod
    def _predict_something(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("0 (evaluate the prompt only) is not supported; -1 = no limit")
        return value

    def limit(self) -> int | None:
        return self._with_n_predict(self.max_tokens, "max_tokens")

    def _with_n_predict(self, limit: int | None, name: str) -> int | None:
        """llama-server's `n_predict` is the same limit as OpenAI's: either may be given, or both alike."""
        native = None if self.n_predict in (None, -1) else self.n_predict
        if native is not None and limit is not None and native != limit:
            raise ApiError(400, f"n_predict ({native}) and {name} ({limit}) disagree: give one of them",
                           param="n_predict", code="invalid_value")
        return limit if limit is not None else native

    def check_agreement(self) -> None:
        """OpenAI's and llama-server's names for the same setting, both given, must agree (else a 400)."""
        self.limit()
        self.preset_overrides()
        _ = self.choices

    @property
    def choices(self) -> int:
        if self.n is not None and self.n_cmpl is not None and self.n != self.n_cmpl:
            raise ApiError(400, f"n ({self.n}) and n_cmpl ({self.n_cmpl}) disagree: give one of them", param="n",
                           code="invalid_value")
        return self.n or self.n_cmpl or 1

    @property
    def slot(self) -> int | None:
        return None if self.id_slot in (None, -1) else self.id_slot

    def preset_overrides(self) -> dict[str, Any]:
        """Preset keys this request sets (seed not included: the server draws one when absent or -1)."""
        keys = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                "frequency_penalty", "context_shift", "n_keep", "n_discard")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        nested = self.speculative or Speculative()
        for key, flat, inner in (("n_draft", self.speculative_n_max, nested.n_max),
                                 ("p_min", self.speculative_p_min, nested.p_min),
                                 ("drafter", self.speculative_type, nested.type)):
            if flat is not None and inner is not None and flat != inner:
                name = FIELD_OF_KEY[key]
                raise ApiError(400, f"{name} ({flat}) and speculative.{name.split('.')[1]} (nested, {inner}) "
                               f"disagree: give one of them", param=name, code="invalid_value")
            out[key] = flat if flat is not None else inner
        spec_type = out.pop("drafter")
        if spec_type == "none":
            out["n_draft"] = 0
        elif spec_type is not None:
            out["drafter"] = SPECULATIVE_TYPES[spec_type]
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts: `_parts` checks them, `_pictures` turns them into text with the picture marker
    # where each image_url part was (its data: URI into `pictures`), so after validation it is always a string.
    content: str | list[dict[str, Any]] = ""
    name: str | None = None
    refusal: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    pictures: list[str] = Field(default_factory=list, exclude=True)  # (not a request field: filled from the parts)

    @model_validator(mode="before")
    @classmethod
    def _no_pictures_field(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pictures" in data:
            raise ValueError("pictures: not a message field (send pictures as image_url content parts)")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> str | list[dict[str, Any]]:
        """A string, null (an assistant turn with no text), or text and image_url parts (`content_parts`)."""
        if value is None or isinstance(value, str):
            if value and MARKER in value:
                raise ValueError(f"text may not hold {MARKER} (the picture marker): send an image_url part")
            return value or ""
        if not isinstance(value, list):
            raise ValueError("expected a string or a list of text and image_url parts")
        content_parts(value)  # (checked here, so an error names the content)
        return value

    @model_validator(mode="after")
    def _pictures(self) -> ChatMessage:
        if isinstance(self.content, list):
            self.content, self.pictures = content_parts(self.content)
        return self

    def as_template_message(self) -> dict[str, Any]:
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role means system.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:  # checked by server/tools.py when the conversation is rendered
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def content_parts(parts: list[Any]) -> tuple[str, list[str]]:
    """OpenAI content parts as (text, data: URIs): text parts joined by newlines, each image_url part as the
    picture marker in its place. A picture is sent inline (a data: URI); an http(s) URL is never fetched."""
    texts: list[str] = []
    pictures: list[str] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f'content[{j}]: expected parts like {{"type": "text", "text": "..."}}')
        if part["type"] == "text":
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f'content[{j}]: a text part is {{"type": "text", "text": "..."}}')
            if MARKER in part["text"]:
                raise ValueError(f"content[{j}]: text may not hold {MARKER} (the picture marker): send an image_url "
                                 "part")
            texts.append(part["text"])
        elif part["type"] == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if set(part) != {"type", "image_url"} or not isinstance(url, str) or (
                    isinstance(image, dict) and not set(image) <= {"url", "detail"}):
                raise ValueError(f'content[{j}]: an image_url part is {{"type": "image_url", "image_url": '
                                 '{"url": "data:image/png;base64,..."}}')
            if re.match(r"(?i)https?:", url):
                raise ValueError(f"content[{j}]: picture URLs are not fetched: send the picture inline, as a "
                                 "data:image/...;base64 URI")
            if not re.match(r"(?i)data:image/[\w.+-]+;base64,", url):
                raise ValueError(f"content[{j}]: a picture is a data:image/<type>;base64,<data> URI")
            texts.append(MARKER)
            pictures.append(url)
        else:
            raise ValueError(f"content[{j}]: parts are text or image_url (got type {part['type']!r})")
    return "\n".join(texts), pictures


_MESSAGE_UNSUPPORTED = {
    "function_call": (_neutral(None), "function calling is not supported"),
    "refusal": (_neutral(None), "refusals cannot be replayed to the model"),
}


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None

    def limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self._with_n_predict(self.max_completion_tokens, "max_completion_tokens")
        return super().limit()

    @field_validator("messages")
    @classmethod
    def _one_assistant_at_the_end(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        """llama-server's rule (server-common.cpp): two assistant turns in a row at the end have no reply to
        prompt for; templates that alternate roles would break on them."""
        if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
            raise ValueError("cannot have 2 or more assistant messages at the end of the list")
        return messages


class MultimodalPrompt(_Strict):
    """llama-server's prompt with pictures: the text, holding one picture marker per entry of `multimodal_data`
    (each a picture's bytes in base64)."""

    prompt_string: str
    multimodal_data: list[str] = Field(default_factory=list)


class CompletionRequest(_Generation):
    # One prompt per request: text, token ids, or llama-server's text with pictures.
    prompt: str | list[int] | MultimodalPrompt
    logprobs: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: str | None = None  # fill-in-the-middle: the prompt is the code before the gap, this the code after

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int] | MultimodalPrompt:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list | dict):
            value = value[0]  # ["text"] or [[ids]]: a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, dict):  # llama-server's {"prompt_string": ..., "multimodal_data": [...]}
            unknown = sorted(set(value) - {"prompt_string", "multimodal_data"})
            if unknown or not isinstance(value.get("prompt_string"), str) or not all(
                    isinstance(d, str) for d in value.get("multimodal_data", [])):
                raise ValueError("an object prompt is {\"prompt_string\": TEXT, \"multimodal_data\": [BASE64, ...]}"
                                 + (f" (unknown field {unknown[0]!r})" if unknown else ""))
            return MultimodalPrompt(**value)
        raise ValueError("expected one prompt: a string, a non-empty list of token ids, or an object with "
                         "prompt_string and multimodal_data")


def parse_body(body: bytes) -> Any:
    """JSON → Python, refusing NaN and Infinity (not JSON, though Python's parser takes them)."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(body, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    _refuse_surrogates(data)
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_surrogates(data: Any) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"): valid JSON, not text (it cannot be encoded to UTF-8 for
    the tokenizer). A 400 naming the first field that holds one."""
    todo: list[tuple[Any, tuple[int | str, ...]]] = [(data, ())]
    while todo:
        value, loc = todo.pop()
        if isinstance(value, str):
            found = None if value.isascii() else _SURROGATE.search(value)
            if found:
                param = _param(loc)
                raise ApiError(400, f"{param or 'the request body'}: holds a lone surrogate ({found.group()!a}), "
                               "which is not text: send UTF-8 text", param=param or None, code="invalid_value")
        elif isinstance(value, dict):
            # A key is named by its escaped form: the error itself must be valid UTF-8.
            named = [(key.encode("utf-8", "backslashreplace").decode(), key, item) for key, item in value.items()]
            todo.extend((item, (*loc, name)) for name, _, item in reversed(named))
            todo.extend((key, (*loc, name)) for name, key, _ in named)
        elif isinstance(value, list):
            todo.extend((item, (*loc, i)) for i, item in reversed(list(enumerate(value))))


def parse(cls: type[_Generation], data: Any) -> Any:
    """Validate a decoded body into `cls` (ChatRequest or CompletionRequest), or raise a 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unsupported = _CHAT_UNSUPPORTED if cls is ChatRequest else _COMPLETION_UNSUPPORTED
    _refuse(data, unsupported, "")
    # What passed is neutral: llama.cpp's native fields without a declared home are dropped here.
    data = {k: v for k, v in data.items() if k not in _LLAMA_UNSUPPORTED and k not in _SWITCHED_OFF}
    if cls is ChatRequest and isinstance(data.get("messages"), list):
        for i, message in enumerate(data["messages"]):
            if isinstance(message, dict):
                _refuse(message, _MESSAGE_UNSUPPORTED, f"messages[{i}].")
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, cls) from None
    req.check_agreement()
    return req


def _refuse(data: dict[str, Any], unsupported: dict[str, tuple[Callable[[Any], bool], str]], prefix: str) -> None:
    for name, (neutral, why) in unsupported.items():
        if name in data and not neutral(data[name]):
            raise ApiError(400, f"{prefix}{name}: {why}", param=f"{prefix}{name}", code="unsupported_parameter")


def _explain(exc: ValidationError, cls: type[BaseModel]) -> ApiError:
    """The first validation error as one line naming the field (OpenAI's `param`)."""
    err = exc.errors(include_url=False)[0]
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        name = str(err["loc"][-1])
        known = list(cls.model_fields) if len(err["loc"]) == 1 else []
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        return ApiError(400, f"unknown field {param!r}{suggestion}", param=param, code="unknown_parameter")
    if err["type"] == "missing":
        return ApiError(400, f"{param!r} is required", param=param, code="missing_required_parameter")
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "literal_error":
        message += f" (got {repr(err['input'])[:60]})"
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
