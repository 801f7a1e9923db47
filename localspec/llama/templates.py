"""Chat templates: llama.cpp's built-in ones, and a GGUF's own Jinja template through llama-cpp-python's sandboxed
formatter."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp

from localspec.errors import LocalspecError

ChatMessages = list[dict[str, str]]


def builtin_chat_templates() -> list[str]:
    """The names of llama.cpp's built-in chat templates (`gemma`, `chatml`, `llama3`, ...)."""
    out = (ctypes.c_char_p * 256)()
    n = llama_cpp.llama_chat_builtin_templates(out, 256)
    return [out[i].decode() for i in range(min(n, 256))]


def apply_builtin_template(name: str, messages: ChatMessages) -> str:
    """Render messages with one of llama.cpp's built-in templates, ending with the assistant's turn opened."""
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]  # kept alive during the call
    chat = (llama_cpp.llama_chat_message * len(encoded))()
    for i, (role, content) in enumerate(encoded):
        chat[i].role = role
        chat[i].content = content
    size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
    for _ in range(2):  # the first call reports the size it needs when the buffer is short
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(encoded), True, buf, size)
        if n < 0:
            raise LocalspecError(f"llama.cpp built-in chat template {name!r} failed (code {n})")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise LocalspecError(f"llama.cpp built-in chat template {name!r} kept asking for a larger buffer")


def jinja_chat_renderer(template: str, bos_token: str, eos_token: str, source: str) -> Callable[..., str]:
    """A GGUF's Jinja chat template, rendered by llama-cpp-python's sandboxed formatter (a hostile template cannot
    reach Python). Parse errors become a LocalspecError naming `source`. Keyword arguments of the renderer reach the
    template as variables (the formatter passes them through): Qwen3's `enable_thinking`."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        formatter = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token,
                                        add_generation_prompt=True)
    except jinja2.TemplateError as exc:
        raise LocalspecError(f"chat template ({source}) does not parse: {exc}") from None
    return lambda messages, **variables: formatter(messages=messages, **variables).prompt
