"""Stop strings, matched on the text as it is emitted.

The engine's TokenEvent text is already decoded incrementally (a UTF-8 character split over two tokens arrives as
"" and then the character), so matching works on `str`. A stop string can span tokens, even the tokens of one
accepted draft run, so the matcher holds back any tail of the text that could still grow into a stop string and
releases it only once it cannot: nothing at or after a stop string is ever released.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces in order; get back the text that is safe to emit.

    `matched` becomes the first stop string to complete (the earliest-starting one if a piece completes several);
    from then on nothing more is released. `released` counts the characters released so far, so after a match it
    is where that stop string began.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = tuple(stops)
        self.matched: str | None = None
        self.released = 0
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of (held text + `text`) that can no longer become part of a stop string."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if hit is not None:
            cut, self.matched = hit
            self._held = ""
            return self._release(buf[:cut])
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep :]
        return self._release(buf[: len(buf) - keep])

    def flush(self) -> str:
        """At the end of generation: what is still held (a partial stop string that never completed)."""
        if self.matched is not None:
            return ""
        out, self._held = self._held, ""
        return self._release(out)

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for n in range(min(longest, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, text: str) -> str:
        self.released += len(text)
        return text
