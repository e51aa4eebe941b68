"""The streamed-Markdown feeder keeps the displayed last paragraph short and shows the exact text at the end."""

from __future__ import annotations

import asyncio

from cmpchat.tui.widgets.streamed_markdown import MAX_STREAMED_BLOCK, StreamedMarkdown


class RecordingMarkdown:
    """Stands in for Textual's Markdown: what it was given to show."""

    def __init__(self) -> None:
        self.document = ""
        self.updates = 0

    async def append(self, text: str) -> None:
        self.document += text

    async def update(self, text: str) -> None:
        self.document = text
        self.updates += 1


def stream(pieces: list[str], final: str | None = None) -> tuple[StreamedMarkdown, RecordingMarkdown, list[int]]:
    widget = RecordingMarkdown()
    feeder = StreamedMarkdown(widget)  # type: ignore[arg-type]
    last_blocks = []

    async def run() -> None:
        for piece in pieces:
            await feeder.append(piece)
            last_blocks.append(len(widget.document.rsplit("\n\n", 1)[-1]))
        await feeder.finish(final)

    asyncio.run(run())
    return feeder, widget, last_blocks


def test_an_endless_paragraph_is_shown_in_bounded_blocks_then_exactly() -> None:
    pieces = ["word " * 7 for _ in range(1000)]  # 35,000 characters, no blank line
    feeder, widget, last_blocks = stream(pieces)
    assert max(last_blocks) <= MAX_STREAMED_BLOCK + len(pieces[0])
    assert feeder.text == "".join(pieces) and widget.document == feeder.text and widget.updates == 1


def test_short_paragraphs_and_code_fences_are_shown_as_they_stream() -> None:
    code = "```python\n" + "x = 1  # a long line of code\n" * 200 + "```\n"
    pieces = ["Some text.\n\n", *[code[i : i + 50] for i in range(0, len(code), 50)], "\n\nThe end."]
    feeder, widget, _ = stream(pieces)
    assert widget.document == "".join(pieces) and widget.updates == 0


def test_a_final_text_that_differs_replaces_what_streamed() -> None:
    feeder, widget, _ = stream(["Hello wor"], final="Hello world")
    assert feeder.text == widget.document == "Hello world" and widget.updates == 1
