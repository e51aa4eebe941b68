"""Stop strings over a text stream: text is released unless it may be the start of a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas; releases what is certainly not part of a stop string, stops at the first match."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = [s for s in stop_strings if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that stopped the stream: of those completed at once, the one that starts first, then
        the first given."""

    def feed(self, text: str) -> str:
        """Text that may be shown now; after a match, the text before it and `stopped` is set."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._held += text
        hits = [(at, order) for order, stop in enumerate(self._stops) if (at := self._held.find(stop)) >= 0]
        if hits:
            at, order = min(hits)
            self.stopped, self.matched = True, self._stops[order]
            out, self._held = self._held[:at], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out

    def flush(self) -> str:
        """The held-back tail at the end of generation (it never completed a stop string)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:length]):
                    best = length
                    break
        return best
