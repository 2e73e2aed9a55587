"""User stop strings (OpenAI's `stop`) cut out of streamed reply text."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """User stop strings (OpenAI `stop`) applied to streamed text without leaking a partial match.

    The text is cut right before the first stop string to be complete when read left to right (among
    those completing at the same character, the longest), so the result does not depend on how the
    text was split. Text that may be the start of a stop string is held back until it is known."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string ended the text); after a stop: ("", True)."""
        if self._stopped:
            return "", True
        text = self._held + text
        cut = self._first_match(text)
        if cut is not None:
            self._stopped, self._held = True, ""
            return text[:cut], True
        keep = max((self._partial_length(text, stop) for stop in self._stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, text: str) -> int | None:
        best = None  # (end, -length): earliest end, then longest
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best):
                best = (start + len(stop), -len(stop))
        return None if best is None else best[0] + best[1]

    @staticmethod
    def _partial_length(text: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0
