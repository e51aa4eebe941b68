"""The prompt: a multi-line text area (Enter sends, Ctrl+J adds a line, Up and Down on its first and last
lines go through the messages sent before) and the images attached to it.

Keys that terminals disagree on: Shift+Enter reaches the app only with the kitty keyboard protocol,
so Ctrl+J (a plain line feed everywhere) and Alt+Enter (ESC CR) are the new-line keys that always work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip
from textual.widgets import Static, TextArea

from cmpchat.history.images import StoredImage
from cmpchat.tui.prompt_history import PromptHistory
from cmpchat.tui.slash_commands import completion

PLACEHOLDER = "Enter send · Ctrl+J new line · Ctrl+O image · Esc stop"


def _without_keys(bindings: list[BindingType], taken: set[str]) -> list[BindingType]:
    """`bindings` with the keys in `taken` removed (a binding left with no key is dropped)."""
    kept: list[BindingType] = []
    for binding in bindings:
        if not isinstance(binding, Binding):
            kept.append(binding)
            continue
        keys = [key for key in binding.key.split(",") if key.strip() not in taken]
        if keys:
            kept.append(replace(binding, key=",".join(keys)))
    return kept


class PromptArea(TextArea, inherit_bindings=False):
    """Where the person writes. On Enter it empties itself and posts `Submitted` with the text; what is not
    sent is given back with `restore`.

    TextArea's own Ctrl+E (line end; End still works) and Ctrl+X (cut; Super+X still works) are given up
    to the chat screen's "edit last" and "export", so those keys work while typing.
    """

    BINDINGS = [
        *_without_keys(TextArea.BINDINGS, {"ctrl+e", "ctrl+x", "up", "down"}),
        Binding(
            "up",
            "cursor_up",
            "earlier",
            id="prompt.earlier",
            show=False,
            tooltip="On the first line: the message sent before (again: earlier ones)",
        ),
        Binding(
            "down",
            "cursor_down",
            "later",
            id="prompt.later",
            show=False,
            tooltip="On the last line: the message sent after, then back to the draft",
        ),
        Binding("tab", "complete", "complete", id="prompt.complete", show=False, tooltip="Complete the slash command"),
        Binding("enter", "submit", "send", id="prompt.send", priority=True, show=False, tooltip="Send the message"),
        Binding(
            "ctrl+j,alt+enter,shift+enter", "newline", "new line", id="prompt.newline", show=False, tooltip="New line"
        ),
    ]

    @dataclass
    class Submitted(Message):
        """The person pressed Enter."""

        prompt_area: PromptArea
        text: str

        @property
        def control(self) -> PromptArea:
            return self.prompt_area

    def __init__(self, *, sent: Callable[[], list[str]], id: str | None = None) -> None:
        """`sent` gives the messages sent in the open chat, oldest first, for Up and Down."""
        self.sent_history = PromptHistory(sent)
        super().__init__(
            id=id,
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            compact=True,
            placeholder=PLACEHOLDER,
            highlight_cursor_line=False,
        )

    def render_line(self, y: int) -> Strip:
        # TextArea wraps its placeholder to the content width, and rich cannot wrap to 0 columns (it
        # raises in chop_cells). A prompt squeezed to no columns (a terminal narrower than its border and
        # padding, or the one frame after a jump from wide to narrow) has nothing to show.
        if self.content_size.width < 1:
            return Strip.blank(0)
        return super().render_line(y)

    def action_submit(self) -> None:
        # Enter is a priority binding: the app runs it the moment it reads the key, while keys read just
        # before it (typed ahead, or in the same read) may still wait in this widget's queue. Submitting
        # from that queue takes the text once they are in, and empties the box before any key read after.
        self.call_later(self._submit)

    def _submit(self) -> None:
        text = self.text
        self.clear()
        self.sent_history.reset()
        self.post_message(self.Submitted(self, text))

    def restore(self, text: str) -> None:
        """Put back a message that was not sent, before whatever was typed since."""
        self.insert(text, (0, 0))

    def action_newline(self) -> None:
        self.insert("\n")

    def update_suggestion(self) -> None:
        # TextArea's hook after every edit: the rest of a slash command's name, shown dimmed after the cursor.
        at_end = self.cursor_location == self.document.end
        self.suggestion = completion(self.text) if at_end else ""

    def watch_selection(self) -> None:
        self.update_suggestion()  # the cursor moved away from the end: no completion drawn in mid-text

    def action_complete(self) -> None:
        if not self.suggestion:
            raise SkipAction()  # Tab then moves the focus, as everywhere else
        self.insert(self.suggestion)

    def action_cursor_up(self, select: bool = False) -> None:
        # Only from the top row: above it Up moves the cursor, so a message of several lines stays editable.
        if not select and self.navigator.is_first_wrapped_line(self.cursor_location):
            recalled = self.sent_history.back(self.text)
            if recalled is not None:
                self._show(recalled)
                return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self.navigator.is_last_wrapped_line(self.cursor_location):
            recalled = self.sent_history.forward(self.text)
            if recalled is not None:
                self._show(recalled)
                return
        super().action_cursor_down(select)

    def _show(self, text: str) -> None:
        # An edit rather than `text = ...`, which would empty the undo history (Ctrl+Z brings the text back).
        self.replace(text, (0, 0), self.document.end, maintain_selection_offset=False)
        self.move_cursor(self.document.end)


@dataclass(frozen=True, slots=True)
class Attachment:
    """An image attached to the next message: stored already, shown by the name it had."""

    image: StoredImage
    name: str


class AttachmentBar(Horizontal):
    """The images waiting to be sent with the next message, and why the model cannot see them, if it cannot."""

    attachments: reactive[tuple[Attachment, ...]] = reactive((), recompose=True)
    no_images_reason: reactive[str | None] = reactive(None, recompose=True)
    """`model_request.why_no_images` of the model (None: it sees them, or none is loaded yet)."""

    def compose(self) -> ComposeResult:
        for attachment in self.attachments:
            image = attachment.image
            yield Static(f"▣ {attachment.name} {image.width}×{image.height}", classes="attachment", markup=False)
        if self.attachments and self.no_images_reason:
            yield Static(
                f"the model cannot see images ({self.no_images_reason}); they are kept in history, not sent",
                classes="attachment-warning",
                markup=False,
            )

    def watch_attachments(self, attachments: tuple[Attachment, ...]) -> None:
        self.display = bool(attachments)
