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
- The reply: `<tool_call>` blocks → `tool_calls` (ids `call_...`, arguments as JSON text), the rest is `content`;
  streaming holds text back from a possible marker on and sends each call as one `delta.tool_calls` chunk when its
  block closes.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from localspec.constraints import Constraint
from localspec.llama_ctx import json_schema_gbnf

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


class ToolError(ValueError):
    """A tools field that cannot be used; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools: expected a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
        f = tool["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function: unknown field {sorted(unknown)[0]!r}", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
            raise ToolError(f"{where}.function.name: letters, digits, _ and - only", f"{where}.function.name")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters: expected a JSON schema object",
                            f"{where}.function.parameters")
        functions.append({"name": name, "description": f.get("description", ""), "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools: two functions share a name", "tools")
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
            raise ToolError(f"tool_choice: no tool named {choice!r}", "tool_choice")
    else:
        raise ToolError('tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name"}}',
                        "tool_choice")
    if parallel_tool_calls is not None and type(parallel_tool_calls) is not bool:
        raise ToolError("parallel_tool_calls: expected true or false", "parallel_tool_calls")
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


def split_reply(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply. A block that does not parse stays in the content."""
    scanner = ToolScanner()
    content = scanner.feed(text) + scanner.flush()
    return content.strip() if scanner.calls else content, scanner.calls


class ToolScanner:
    """Text in, content out; `<tool_call>` blocks become `calls`. Holds back what could still be a marker."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> str:
        """The content that is safe to send now; completed calls are appended to `calls`."""
        self._buffer += text
        out = []
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CLOSE)
                if end < 0:
                    return "".join(out)
                body = self._buffer[:end]
                call = _call(body)
                if call is None:  # not a call after all: keep it as text
                    out.append(TOOL_OPEN + body + TOOL_CLOSE)
                else:
                    self.calls.append(call)
                self._buffer = self._buffer[end + len(TOOL_CLOSE) :]
                self._inside = False
                continue
            at = self._buffer.find(TOOL_OPEN)
            if at >= 0:
                out.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(TOOL_OPEN) :]
                self._inside = True
                continue
            keep = _partial_marker(self._buffer)
            out.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return "".join(out)

    def flush(self) -> str:
        """The end of the reply: an unfinished block or a held-back partial marker is content."""
        rest = (TOOL_OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return rest


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` could begin a marker."""
    for n in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_OPEN.startswith(text[-n:]):
            return n
    return 0
