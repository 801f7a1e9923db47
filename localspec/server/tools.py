"""Tool calling in OpenAI's shapes over the Hermes `<tool_call>` format (Qwen2.5 and Qwen3 write it natively).

- `tools`, `tool_choice` (`auto`, `none`, `required`, `{"type": "function", "function": {"name"}}`) and
  `parallel_tool_calls` → `ToolRequest`.
- The prompt: a chat template that reads `tools` (Qwen's) gets them as the variable it expects, and assistant
  `tool_calls` / `role: tool` messages as they are; any other template gets the tools described in a system
  message in the same format, earlier calls written back as `<tool_call>` blocks and results as
  `<tool_response>` blocks in a user turn.
- The grammar: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` with the arguments held to
  the function's JSON schema. `auto`: lazy, free text until the marker; `required` / a named function: from the
  first token. After the call(s) only the end of the turn is legal, so the reply ends where the calls end.
- The reply: `<tool_call>` blocks → `tool_calls` (ids `call_...`, arguments as the JSON text the model wrote), the
  rest is `content`. One scanner for both paths: streaming sends a call's id and name once the name is known, then
  its arguments in pieces as they are written (OpenAI's incremental `delta.tool_calls`); a whole reply is the same
  scanner fed at once.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from localspec.llama.grammar import json_schema_gbnf
from localspec.rounds.constraints import Constraint
from localspec.server.errors import ApiError

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def _refused(message: str, param: str) -> ApiError:
    """A tools field that cannot be used: a 400 naming it."""
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} each
    choice: str  # "auto", "required", or a function's name
    parallel: bool

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> Constraint:
        return Constraint(tool_gbnf(self), "tools", trigger=TOOL_OPEN if self.choice == "auto" else None)


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tool fields; None when no tool may be called (no tools, or tool_choice "none")."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise _refused("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _refused("tools: expected a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _refused(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
        f = tool["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _refused(f"{where}.function: unknown field {sorted(unknown)[0]!r}", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
            raise _refused(f"{where}.function.name: letters, digits, _ and - only", f"{where}.function.name")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _refused(f"{where}.function.parameters: expected a JSON schema object",
                           f"{where}.function.parameters")
        functions.append({"name": name, "description": f.get("description", ""), "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _refused("tools: two functions share a name", "tools")
    if tool_choice is None or tool_choice == "auto":
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        choice = tool_choice["function"]["name"]
        if choice not in names:
            raise _refused(f"tool_choice: no tool named {choice!r}", "tool_choice")
    else:
        raise _refused('tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name"}}',
                       "tool_choice")
    if parallel_tool_calls is not None and type(parallel_tool_calls) is not bool:
        raise _refused("parallel_tool_calls: expected true or false", "parallel_tool_calls")
    return ToolRequest(tuple(functions), choice, parallel_tool_calls is not False)


def tool_gbnf(request: ToolRequest) -> str:
    """One `<tool_call>` block per call, its JSON held to {"name": one of the functions, "arguments": its
    parameters' schema} (JSON schema → GBNF by the same converter as response_format)."""
    allowed = [f for f in request.functions if request.choice in ("auto", "required", f["name"])]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                          "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in allowed]}
    body = json_schema_gbnf(schema, "tools")
    lines = [("tool-call-body ::=" + line.removeprefix("root ::=")) if line.startswith("root ::=") else line
             for line in body.splitlines()]
    calls = "tool-call (tool-gap tool-call)*" if request.parallel else "tool-call"
    return "\n".join([
        f"root ::= {calls}",
        f'tool-call ::= "{TOOL_OPEN}" tool-gap tool-call-body tool-gap "{TOOL_CLOSE}"',
        'tool-gap ::= [ \\n]{0,2}',
        *lines,
    ])


# -- the prompt ------------------------------------------------------------------------------------------------

_SYSTEM = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_reads_tools(template_text: str | None) -> bool:
    return bool(template_text) and "tools" in template_text


def messages_for_template(messages: list[dict[str, Any]], request: ToolRequest | None,
                          native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables): native templates get `tools` and the tool messages as they are; others a
    system message describing the tools and the calls and results written out as text."""
    if native:
        return messages, ({"tools": request.template_tools()} if request is not None else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"{TOOL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CLOSE}"
                      for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *blocks]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if request is not None:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in request.template_tools())
        system = _SYSTEM.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    f = call.get("function", {})
    arguments = f.get("arguments", "{}")
    with contextlib.suppress(ValueError):  # text that is not JSON is replayed as the client sent it
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return {"name": f.get("name", ""), "arguments": arguments}


# -- the reply -------------------------------------------------------------------------------------------------

# The head of a call as the grammar writes it: the name, then the arguments' value (its first character in view).
# Once it matches, the call is announced and its arguments stream as the model writes them.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class CallDelta:
    """One piece of a call, OpenAI's `delta.tool_calls[]`: the first carries id, type and name (and the arguments
    so far, maybe ""), later ones only more arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | CallDelta  # content text, or a piece of a call


def split_reply(text: str) -> tuple[str, list[dict[str, Any]], bool]:
    """(content, tool_calls, whether the last call was cut short) of a whole reply: the streaming scanner fed it
    at once, so both paths agree."""
    scanner = ToolScanner()
    pieces = scanner.feed(text) + scanner.flush()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content.strip() if scanner.calls else content, scanner.calls, scanner.unfinished


class ToolScanner:
    """Text in, pieces out, in order: content, and each `<tool_call>` block as a call announced once its name is
    known, then its arguments' text as the model writes it (their concatenation is the call's arguments). What it
    decides depends on the text alone, never on how the text was split. It holds back only what could still be a
    marker and a call's head until the name is known. A block whose head is not `{"name": ..., "arguments": ...}`
    (never so under the tools grammar) is parsed when it closes; one that is not a call after all stays content."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool_calls, arguments as far as written
        self.unfinished = False  # the reply ended inside a call's arguments (max_tokens, a stop string)
        self._buffer = ""
        self._state = "text"  # text → head → arguments → tail → text
        self._value = _JsonValue()

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while {"text": self._text, "head": self._head, "arguments": self._arguments, "tail": self._tail}[
                self._state](out):
            pass
        return out

    def flush(self) -> list[Piece]:
        """The end of the reply: an unfinished head or a held-back partial marker is content; a call cut inside
        its arguments keeps what was written of them."""
        out: list[Piece] = []
        if self._state == "text":
            _put(out, self._buffer)
        elif self._state == "head":
            _put(out, TOOL_OPEN + self._buffer)
        elif self._state == "arguments":
            self._more_arguments(out, self._buffer)
            self.unfinished = True
        self._buffer, self._state = "", "text"
        return out

    # Each state reads the buffer and says whether it moved to another state (then that one reads on).

    def _text(self, out: list[Piece]) -> bool:
        at = self._buffer.find(TOOL_OPEN)
        if at < 0:
            keep = _partial(self._buffer, TOOL_OPEN)
            _put(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        _put(out, self._buffer[:at])
        self._buffer, self._state = self._buffer[at + len(TOOL_OPEN) :], "head"
        return True

    def _head(self, out: list[Piece]) -> bool:
        close = self._buffer.find(TOOL_CLOSE)
        # Without the close marker in view, a possible start of it is not looked at yet: the same decision
        # whether the text comes at once or in pieces.
        seen = self._buffer[:close] if close >= 0 else \
            self._buffer[: len(self._buffer) - _partial(self._buffer, TOOL_CLOSE)]
        match = _HEAD.match(seen)
        name = _json_string(match.group(1)) if match else None
        if match and name is not None:
            self.calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            out.append(CallDelta(len(self.calls) - 1, "", self.calls[-1]["id"], name))
            self._buffer, self._state, self._value = self._buffer[match.end() :], "arguments", _JsonValue()
            return True
        if close < 0:
            return False
        call = _call(seen)  # a head in another shape: the whole block, parsed now that it has closed
        if call is None:  # not a call after all: keep it as text
            _put(out, TOOL_OPEN + seen + TOOL_CLOSE)
        else:
            self.calls.append(call)
            out.append(CallDelta(len(self.calls) - 1, call["function"]["arguments"], call["id"],
                                 call["function"]["name"]))
        self._buffer, self._state = self._buffer[close + len(TOOL_CLOSE) :], "text"
        return True

    def _arguments(self, out: list[Piece]) -> bool:
        """The arguments' JSON value, up to where it closes. Outside a JSON string the close marker cannot be part
        of it: there the marker ends a (malformed) call, and what could be its start is held back."""
        buffer = self._buffer
        for i, c in enumerate(buffer):
            if c == "<" and not self._value.in_string:
                rest = buffer[i:]
                if rest.startswith(TOOL_CLOSE):
                    self._more_arguments(out, buffer[:i])
                    self._buffer, self._state = rest[len(TOOL_CLOSE) :], "text"
                    return True
                if TOOL_CLOSE.startswith(rest):
                    self._more_arguments(out, buffer[:i])
                    self._buffer = rest
                    return False
            ends = self._value.step(c)
            if ends is not None:
                end = i + ends
                self._more_arguments(out, buffer[:end])
                self._buffer, self._state = buffer[end:], "tail"
                return True
        self._more_arguments(out, buffer)
        self._buffer = ""
        return False

    def _tail(self, out: list[Piece]) -> bool:
        """After the arguments: the object's `}` up to the close marker, sent nowhere."""
        close = self._buffer.find(TOOL_CLOSE)
        if close < 0:
            return False
        self._buffer, self._state = self._buffer[close + len(TOOL_CLOSE) :], "text"
        return True

    def _more_arguments(self, out: list[Piece], text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            _put(out, CallDelta(len(self.calls) - 1, text))


class _JsonValue:
    """Where one JSON value (written by the model) ends, a character at a time: brackets open, inside a string,
    after a backslash. Hand-written: the streaming JSON parsers around parse values, this only finds an end."""

    def __init__(self) -> None:
        self.in_string = False
        self._started = False
        self._depth = 0
        self._escaped = False
        self._scalar = False  # a number or literal at the top: ends before its delimiter

    def step(self, c: str) -> int | None:
        """None: the value goes on; 1: it ends with `c`; 0: it ended before `c`."""
        if not self._started:
            self._started = True
            if c in "{[":
                self._depth = 1
            elif c == '"':
                self.in_string = True
            else:
                self._scalar = True
            return None
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self.in_string = False
                return 1 if self._depth == 0 else None
            return None
        if self._scalar:
            return 0 if c in " \t\r\n,}]" else None
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            return 1 if self._depth == 0 else None
        return None


def _put(out: list[Piece], piece: Piece) -> None:
    """Append, merging with the piece before when it is of the same kind (text after text, the same call's
    arguments after its own)."""
    if not piece:
        return
    last = out[-1] if out else None
    if isinstance(piece, str) and isinstance(last, str):
        out[-1] = last + piece
    elif isinstance(piece, CallDelta) and isinstance(last, CallDelta) and last.index == piece.index:
        last.arguments += piece.arguments
    else:
        out.append(piece)


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value.get("arguments", {}),
                                                                        ensure_ascii=False)}}


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
