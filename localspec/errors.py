"""Errors a user can act on: one tree, one line each. The CLI prints them and exits with `exit_code`.

Everything a user can reach raises a `LocalspecError` subclass whose message names the culprit (file, key,
token id, option); a `ValueError` or an `assert` reaching a user is a bug. Tracebacks only with
LOCALSPEC_DEBUG=1.
"""

from __future__ import annotations


class LocalspecError(Exception):
    """A known failure with a message that names the culprit (file, key, token id)."""

    exit_code = 2


class UsageError(LocalspecError):
    """The request cannot be run as asked (an empty prompt, a bench without a draft, --draft without --target)."""


class ConfigError(LocalspecError):
    """A preset, models.toml or default-pair problem: the message names the file and key."""


class GGUFError(LocalspecError):
    """The file is not a readable GGUF file, or a header value has the wrong type or range; the message names it."""


class HubError(LocalspecError):
    """A download problem with a one-line cause (404, 401/gated, network, disk, checksum, another pull)."""


class WriteError(LocalspecError):
    """A file localspec writes could not be written (read-only, full, a folder in the way); names the path."""


class ModelLoadError(LocalspecError):
    """llama.cpp could not load a model or create its context."""


class DecodeError(LocalspecError):
    """llama.cpp failed while generating (a decode, the device sampler or a KV rewind), after a good load."""


class IncompatiblePairError(LocalspecError):
    """Target and draft cannot be used together (tokenizer mismatch). An error like any other (exit 2); `localspec
    check`'s verdict "incompatible" is an answer, not an error, and exits 1."""


class ContextFullError(LocalspecError):
    """The prompt alone does not fit the context window."""


class TooManyTokens(LocalspecError):
    """A text has more tokens than the caller allowed: found out without keeping them. `tokens` is the count, or
    (not `exact`) the count so far when the rest was not tokenized."""

    def __init__(self, message: str, tokens: int, exact: bool = True) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.exact = exact


class GrammarError(UsageError):
    """A grammar or JSON schema that cannot constrain generation (does not parse, cannot be converted), or a
    token it forbids; the message names the source (file, request field)."""


class RollbackError(UsageError):
    """Speculative decoding on a model whose recurrent state this llama.cpp cannot roll back (too old a library,
    or an architecture without snapshots): the message says which, and that plain decoding works."""
