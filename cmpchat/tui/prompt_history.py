"""Up and Down in the prompt: going back through the messages sent in the open chat, and forward again to
the draft that was being typed. No Textual here; `PromptArea` asks it when the cursor is on its first or
last line."""

from __future__ import annotations

from collections.abc import Callable


class PromptHistory:
    """Where the person is among the messages `sent()` returns (oldest first), and the draft to come back to.

    A recalled message that is then edited ends the browsing: the edited text becomes the draft, and the next
    Up starts again from the newest message."""

    def __init__(self, sent: Callable[[], list[str]]) -> None:
        self._sent = sent
        self._entries: list[str] = []
        self._index: int | None = None
        """Position in `_entries` of the message shown; None while the person's own text is shown."""
        self._draft = ""

    def back(self, current: str) -> str | None:
        """The message before the one shown (`current` is the prompt's text), or None when there is none."""
        if self._index is not None and current != self._entries[self._index]:
            self._index = None
        if self._index is None:
            self._entries = _without_repeats(self._sent())
            self._draft, self._index = current, len(self._entries)
        if self._index == 0:
            if not self._entries:
                self._index = None
            return None
        self._index -= 1
        return self._entries[self._index]

    def forward(self, current: str) -> str | None:
        """The message after the one shown, the draft after the newest, or None when not browsing."""
        if self._index is None or current != self._entries[self._index]:
            self._index = None
            return None
        self._index += 1
        if self._index == len(self._entries):
            self._index = None
            return self._draft
        return self._entries[self._index]

    def reset(self) -> None:
        """The prompt's text was sent: the next Up starts from the newest message."""
        self._index = None
        self._draft = ""


def _without_repeats(texts: list[str]) -> list[str]:
    """`texts` without a message sent again straight after itself (one Up per distinct message)."""
    return [text for i, text in enumerate(texts) if i == 0 or text != texts[i - 1]]
