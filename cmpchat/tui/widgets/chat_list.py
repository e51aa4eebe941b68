"""The chat list: newest first, with full-text search over titles and messages, rename and delete."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, OptionList
from textual.widgets.option_list import Option

from cmpchat.history.store import SearchHit

SearchFunction = Callable[[str], list[SearchHit]]


class ChatRows(OptionList):
    """The list itself; its keys act on the highlighted chat."""

    BINDINGS = [
        Binding("r", "rename", "rename", id="chats.rename", tooltip="Rename the chat (in the chat list)"),
        Binding("delete,d", "delete", "delete", id="chats.delete", tooltip="Delete the chat (in the chat list)"),
        Binding("slash", "search", "search", id="chats.search", tooltip="Search the chats (in the chat list)"),
    ]

    def action_search(self) -> None:
        self.query_ancestor(ChatList).focus_search()

    def action_rename(self) -> None:
        chat_id = self.highlighted_chat()
        if chat_id is not None:
            self.post_message(ChatList.RenameRequested(chat_id))

    def action_delete(self) -> None:
        chat_id = self.highlighted_chat()
        if chat_id is not None:
            self.post_message(ChatList.DeleteRequested(chat_id))

    def highlighted_chat(self) -> int | None:
        if self.highlighted is None:
            return None
        option_id = self.get_option_at_index(self.highlighted).id
        return int(option_id) if option_id else None


class ChatList(Vertical):
    """A search box over the list of chats. `search(text)` supplies the rows; `refresh_chats` re-runs it."""

    @dataclass
    class Selected(Message):
        chat_id: int

    @dataclass
    class RenameRequested(Message):
        chat_id: int

    @dataclass
    class DeleteRequested(Message):
        chat_id: int

    def __init__(self, search: SearchFunction, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._search = search
        self.current_chat: int | None = None
        self._listed_current: int | None = None
        """The open chat when the list was last filled."""

    def compose(self) -> ComposeResult:
        yield ChatRows(id="chat-options")
        yield Input(placeholder="/ search chats", id="chat-search", compact=True)

    def on_mount(self) -> None:
        self.refresh_chats()

    def refresh_chats(self) -> None:
        """List the chats again. The highlight goes to the open chat when another chat has been opened;
        else it stays on its chat or, when that chat is gone (deleted, or no longer matching the search),
        on the row where it was."""
        options = self.query_one(ChatRows)
        row, chat = options.highlighted, options.highlighted_chat()
        opened, self._listed_current = self.current_chat != self._listed_current, self.current_chat
        text = self.query_one("#chat-search", Input).value
        hits = self._search(text)
        options.clear_options()
        options.add_options([_option(hit, hit.chat.id == self.current_chat) for hit in hits])
        if not hits:
            options.add_option(
                Option(Text("no chats yet" if not text else "no chat matches", style="dim"), disabled=True)
            )
            return
        ids = [hit.chat.id for hit in hits]
        if (opened or row is None) and self.current_chat in ids:
            options.highlighted = ids.index(self.current_chat)
        elif chat in ids:
            options.highlighted = ids.index(chat)
        elif row is not None:
            options.highlighted = min(row, len(ids) - 1)

    def focus_search(self) -> None:
        self.query_one("#chat-search", Input).focus()

    @on(Input.Changed, "#chat-search")
    def _search_changed(self) -> None:
        self.refresh_chats()

    @on(Input.Submitted, "#chat-search")
    def _search_submitted(self) -> None:
        options = self.query_one(ChatRows)
        if options.option_count and not options.get_option_at_index(0).disabled:
            options.highlighted = 0
            options.focus()

    @on(OptionList.OptionSelected, "#chat-options")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.post_message(self.Selected(int(event.option.id)))


TITLE_WIDTH = 22
"""Characters of a chat title shown in the list (28 columns, less the marker, padding and scroll bar)."""


def _option(hit: SearchHit, current: bool) -> Option:
    title = hit.chat.title if len(hit.chat.title) <= TITLE_WIDTH else hit.chat.title[: TITLE_WIDTH - 1] + "…"
    label = Text(("▸ " if current else "  ") + title, no_wrap=True)
    if current:
        label.stylize("bold")
    if hit.snippet:
        snippet = hit.snippet if len(hit.snippet) <= 2 * TITLE_WIDTH else hit.snippet[: 2 * TITLE_WIDTH - 1] + "…"
        label.append("\n  " + snippet, style="dim italic")
    else:
        label.append("\n  " + _age(hit.chat.updated_at), style="dim")
    return Option(label, id=str(hit.chat.id))


def _age(timestamp: float) -> str:
    seconds = max(time.time() - timestamp, 0)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return time.strftime("%d %b %Y", time.localtime(timestamp))
