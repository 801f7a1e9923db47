"""Driving a ChatSession turn in the chat tests."""

from __future__ import annotations

from localspec.rounds.events import DoneEvent, TokenEvent
from localspec.sessions.chat import ChatSession


def reply(chat: ChatSession, text: str) -> tuple[list[int], DoneEvent | None]:
    """Send `text` and collect the reply's token ids and its DoneEvent."""
    tokens, done = [], None
    for event in chat.send(text):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
        elif isinstance(event, DoneEvent):
            done = event
    return tokens, done
