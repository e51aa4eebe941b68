"""The conversation: every turn of the open chat, following the newest text unless the reader scrolled up."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from cmpchat.history.store import MessageRecord
from cmpchat.tui.widgets.messages import ReplyView, UserMessage

_EMPTY_HINT = (
    "Type a message below and press [b]Enter[/b].\n"
    "Ctrl+J new line · Ctrl+T thinking on/off · Ctrl+S system prompt and sampling · F1 all keys"
)


class Conversation(VerticalScroll):
    """Turns in order. Anchored to the bottom: new text keeps it there until the reader scrolls up,
    and scrolling back to the bottom re-attaches it (Textual's `anchor`)."""

    def on_mount(self) -> None:
        self.anchor()

    async def show(self, records: Sequence[MessageRecord], image_path: Callable[[str], Path]) -> None:
        """Replace what is shown with the stored turns of a chat, each reply labelled with its model."""
        await self.remove_children()
        views: list[Widget] = []
        for record in records:
            if record.role == "user":
                views.append(UserMessage(record.content, [image_path(i) for i in record.images]))
            elif record.role == "assistant":
                views.append(ReplyView(record.model or "assistant", record))
        if not views:
            views.append(Static(_EMPTY_HINT, classes="empty-hint"))
        await self.mount_all(views)
        self.anchor()

    async def add_user(self, text: str, images: Sequence[Path]) -> UserMessage:
        await self._drop_hint()
        for turn in self.turns:
            turn.remove_class("-selected")  # the copy keys go back to the newest turn
        view = UserMessage(text, images)
        await self.mount(view)
        self.anchor()
        return view

    async def add_reply(self, model_label: str) -> ReplyView:
        view = ReplyView(model_label)
        await self.mount(view)
        self.anchor()
        return view

    async def remove_last(self, count: int) -> None:
        """Remove the last `count` turns (for regenerate and edit)."""
        turns = self.turns
        for view in turns[len(turns) - count :] if count else []:
            await view.remove()

    @property
    def waiting_for_model(self) -> bool:
        """Whether the last message waits for a model to reply to it (sent while none was loaded)."""
        return bool(self.query_children("#waiting-for-model"))

    async def wait_for_model(self, note: str) -> None:
        """Say under the last message that its reply waits for the model."""
        await self.mount(Static(note, id="waiting-for-model", markup=False))
        self.anchor()

    def update_waiting(self, note: str) -> None:
        self.query_one("#waiting-for-model", Static).update(note)

    async def stop_waiting(self) -> None:
        for note in self.query_children("#waiting-for-model"):
            await note.remove()

    @property
    def turns(self) -> list[UserMessage | ReplyView]:
        return [child for child in self.children if isinstance(child, UserMessage | ReplyView)]

    def selected_turn(self) -> UserMessage | ReplyView | None:
        """The turn picked with `select`, else the last one (what a copy key copies)."""
        turns = self.turns
        picked = [turn for turn in turns if turn.has_class("-selected")]
        return picked[0] if picked else (turns[-1] if turns else None)

    def select(self, step: int) -> UserMessage | ReplyView | None:
        """Pick the turn `step` turns before (-1) or after (+1) the picked one, and show it."""
        turns = self.turns
        current = self.selected_turn()
        if current is None:
            return None
        index = min(max(turns.index(current) + step, 0), len(turns) - 1)
        for turn in turns:
            turn.set_class(turn is turns[index], "-selected")
        turns[index].scroll_visible()
        return turns[index]

    def last_reply(self) -> ReplyView | None:
        replies = list(self.query_children(ReplyView))
        return replies[-1] if replies else None

    async def _drop_hint(self) -> None:
        for hint in self.query_children(".empty-hint"):
            await hint.remove()
