"""How one turn looks: the person's message (with image thumbnails), and a reply with its folded
reasoning, tool calls, Markdown answer and speed line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import PIL.Image
from PIL import UnidentifiedImageError
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Markdown, Static
from textual_image.widget import Image

from cmpchat.chat.messages import ToolCall
from cmpchat.history.store import MessageRecord, MessageStatus
from cmpchat.tui.format import rate, seconds
from cmpchat.tui.session import ReplyStats
from cmpchat.tui.widgets.streamed_markdown import StreamedMarkdown, shared_parser

_STATUS_NOTES: dict[str, str] = {
    "stopped": "stopped",
    "interrupted": "interrupted (cut off: the app ended, or the server's stream broke)",
    "streaming": "interrupted (the app ended during this reply)",
    "error": "failed",
}


class UserMessage(Vertical):
    """What the person sent."""

    DEFAULT_CLASSES = "turn user-turn"

    def __init__(self, text: str, images: Sequence[Path] = ()) -> None:
        super().__init__()
        self.text = text
        self.images = list(images)

    def compose(self) -> ComposeResult:
        yield Label("you", classes="role")
        if self.images:
            with Horizontal(classes="thumbnails"):
                for path in self.images:
                    yield _thumbnail(path)
        yield Static(self.text, classes="body", markup=False)


def _thumbnail(path: Path) -> Widget:
    """The image's thumbnail, or a line saying it is gone or unreadable (a chat must open whatever its files)."""
    if not path.exists():
        return Static(f"[image missing: {path.name}]", classes="thumbnail-missing", markup=False)
    try:
        return Image(path, classes="thumbnail")
    except (OSError, ValueError, UnidentifiedImageError, PIL.Image.DecompressionBombError):
        return Static(f"[image unreadable: {path.name}]", classes="thumbnail-missing", markup=False)


class ReasoningBlock(Collapsible):
    """The model's reasoning: open while it streams, folded to one line once the answer starts."""

    def __init__(self, text: str = "", *, title: str = "thinking…", collapsed: bool = False) -> None:
        body = Markdown(text, classes="reasoning-text", parser_factory=shared_parser)
        self._stream = StreamedMarkdown(body, text)
        super().__init__(body, title=title, collapsed=collapsed, classes="reasoning")

    @property
    def text(self) -> str:
        return self._stream.text

    async def append(self, text: str) -> None:
        await self._stream.append(text)

    async def finish(self) -> None:
        await self._stream.finish()


class ToolCallView(Collapsible):
    """A tool call the model made: its name and arguments on one line, the full JSON when expanded."""

    def __init__(self, call: ToolCall) -> None:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        short = arguments if len(arguments) <= 60 else arguments[:59] + "…"
        body = Static(Text(json.dumps(call.arguments, ensure_ascii=False, indent=2)), classes="tool-arguments")
        super().__init__(body, title=f"tool call · {call.name}({short})", collapsed=True, classes="tool-call")


class ReplyView(Vertical):
    """One reply. Built finished from history, or empty and fed by `append` while it streams."""

    DEFAULT_CLASSES = "turn reply-turn"

    def __init__(self, model_label: str, record: MessageRecord | None = None) -> None:
        super().__init__()
        self.model_label = model_label
        self.record = record
        self.reasoning_block: ReasoningBlock | None = None
        self.markdown = Markdown(record.content if record else "", classes="body", parser_factory=shared_parser)
        self.stats_line = Static("", classes="reply-stats")
        self._stream = StreamedMarkdown(self.markdown, record.content if record else "")
        self._tools = Vertical(classes="tool-calls")

    def compose(self) -> ComposeResult:
        yield Label(self.model_label, classes="role")
        record = self.record
        if record is not None and record.reasoning:
            title = _reasoning_title(ReplyStats.from_dict(record.stats))
            self.reasoning_block = ReasoningBlock(record.reasoning, title=title, collapsed=True)
            yield self.reasoning_block
        with self._tools:
            for call in record.tool_calls if record else []:
                yield ToolCallView(ToolCall(call.get("name", "?"), call.get("arguments", {}), call.get("id", "")))
        yield self.markdown
        yield self.stats_line

    def on_mount(self) -> None:
        if self.record is not None:
            self.show_stats(ReplyStats.from_dict(self.record.stats), self.record.status)

    @property
    def content(self) -> str:
        return self._stream.text

    @property
    def reasoning(self) -> str:
        return self.reasoning_block.text if self.reasoning_block else ""

    async def append(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall]) -> None:
        """Add streamed text. Markdown.append re-parses only from the last block; the caller already
        coalesces deltas, so Textual's MarkdownStream (a second coalescing layer on its own task, which
        would draw extra frames between ours) is not used."""
        if reasoning:
            if self.reasoning_block is None:
                self.reasoning_block = ReasoningBlock()
                await self.mount(self.reasoning_block, before=self._tools)
            await self.reasoning_block.append(reasoning)
        for call in tool_calls:
            await self._tools.mount(ToolCallView(call))
        if content:
            await self._stream.append(content)

    def fold_reasoning(self, thought_seconds: float) -> None:
        if self.reasoning_block is not None and not self.reasoning_block.collapsed:
            self.reasoning_block.collapsed = True
            self.reasoning_block.title = f"thought for {seconds(thought_seconds)}"

    async def finish(self, content: str, status: MessageStatus, stats: ReplyStats | None) -> None:
        """End the stream; `content` is the full answer, which replaces what streamed if they differ."""
        if self.reasoning_block is not None:
            await self.reasoning_block.finish()
            # Folded when the answer started; a reply stopped, failed or cut off while thinking never got
            # there, and its block must not go on saying "thinking…".
            self.reasoning_block.title = _reasoning_title(stats)
        await self._stream.finish(content)
        self.show_stats(stats, status)

    def show_error(self, message: str) -> None:
        self.stats_line.update(Text(message, style="bold"))
        self.stats_line.add_class("-error")

    def show_stats(self, stats: ReplyStats | None, status: MessageStatus) -> None:
        parts = []
        if stats is not None and stats.generated_tokens:
            parts += [
                f"{rate(stats.decode_tokens_per_second)} tok/s",
                f"{stats.generated_tokens} tokens",
                f"first token {seconds(stats.time_to_first_token)}",
            ]
        note = _STATUS_NOTES.get(status)
        if note:
            parts.append(note)
            self.stats_line.add_class(f"-{status}")
        self.stats_line.update(" · ".join(parts))


def _reasoning_title(stats: ReplyStats | None) -> str:
    """The title of a finished reply's reasoning block."""
    if stats is not None and stats.reasoning_seconds:
        return f"thought for {seconds(stats.reasoning_seconds)}"
    return "reasoning"
