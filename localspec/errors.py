"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class LocalspecError(Exception):
    """A known failure with a message that names the culprit (file, key, token id)."""

    exit_code = 2


class ConfigError(LocalspecError):
    """A preset or models.toml problem: the message names the file and key."""


class ModelLoadError(LocalspecError):
    """llama.cpp could not load a model or create its context."""


class IncompatiblePairError(LocalspecError):
    """Target and draft cannot be used together (tokenizer mismatch)."""

    exit_code = 1


class ContextFullError(LocalspecError):
    """The prompt alone does not fit the context window."""
