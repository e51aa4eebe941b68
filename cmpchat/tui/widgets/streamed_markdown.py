"""Feeding streamed text to a Markdown widget without frames that grow with the paragraph.

Textual's `Markdown.append` re-parses and re-wraps the document's last block on every call, so a reply
that never starts a new paragraph (a model stuck in a loop, or a random-weight benchmark model) makes each
screen update cost more than the last, and the UI thread's GIL time comes out of the engine's speed: on
an 8,000-token single-paragraph reply the app decoded at 0.7 of `cmpchat run` (tiny model, CPU). So while
a paragraph streams past `MAX_STREAMED_BLOCK` characters the display starts a new one; only the display
differs, and it is redrawn from the exact text when the stream ends.
"""

from __future__ import annotations

import functools
import re

from markdown_it import MarkdownIt
from textual.widgets import Markdown

MAX_STREAMED_BLOCK = 2000
"""Characters the last displayed paragraph of a streaming text may reach before the display breaks it."""
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})", re.MULTILINE)
"""A code fence line; inside a fenced block a blank line would not end the block, so nothing is broken."""


@functools.cache
def shared_parser() -> MarkdownIt:
    """The one Markdown parser every message widget uses (pass as `parser_factory`). By default Textual
    builds a parser for each parse, and building one (its linkify rules compile large regular expressions)
    cost more than the parse itself: most of the app's time per streamed update on the H200.

    HTML is not recognised: Textual's Markdown draws no HTML and drops its tokens, so `<br>`, `<div>` or a
    literal `<think>` in a reply vanished. Without it such text stays text and is shown as written."""
    return MarkdownIt("gfm-like", {"html": False})


class StreamedMarkdown:
    """The text streamed into one Markdown widget (`text`), and what the widget was given to show."""

    def __init__(self, widget: Markdown, text: str = "") -> None:
        self.widget = widget
        self.text = text
        self._shown = text

    async def append(self, delta: str) -> None:
        self.text += delta
        start = self._shown.rfind("\n\n")
        block = len(self._shown) - (start + 2 if start >= 0 else 0)
        if (
            block + len(delta) > MAX_STREAMED_BLOCK
            and "\n\n" not in delta
            and len(_FENCE.findall(self._shown)) % 2 == 0
        ):
            cut = delta.find(" ") + 1  # after the first space, else at the start
            delta = f"{delta[:cut]}\n\n{delta[cut:]}"
        self._shown += delta
        await self.widget.append(delta)

    async def finish(self, text: str | None = None) -> None:
        """The stream has ended (with `text` as the whole text, when given): show exactly the text."""
        if text is not None:
            self.text = text
        if self._shown != self.text:
            self._shown = self.text
            await self.widget.update(self.text)
