"""Full-screen overlays for narrow terminals: the chat list and the GPU panel."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label

from cmpchat.gpu_readings import GpuReading, GpuStage
from cmpchat.tui.widgets.chat_list import ChatList, SearchFunction
from cmpchat.tui.widgets.gpu_panel import GpuPanel


class ChatListScreen(ModalScreen[int | None]):
    """The chat list over the conversation; dismisses with the chosen chat's id. Rename and delete
    requests are passed on to the screen below."""

    BINDINGS = [Binding("escape,f2", "close", "Close", id="overlay.close")]

    def __init__(self, search: SearchFunction, current_chat: int | None, *, focus_search: bool = False) -> None:
        super().__init__(classes="overlay-screen")
        self.search = search
        self.current_chat = current_chat
        self.focus_search = focus_search

    def compose(self) -> ComposeResult:
        with Vertical(classes="overlay"):
            yield Label("Chats  [dim](Enter open · r rename · Del delete · Esc close)[/dim]", classes="dialog-title")
            chat_list = ChatList(self.search, id="overlay-chat-list")
            chat_list.current_chat = self.current_chat
            yield chat_list

    def on_mount(self) -> None:
        chat_list = self.query_one(ChatList)
        if self.focus_search:
            chat_list.focus_search()
        else:
            chat_list.query_one("#chat-options").focus()

    @on(ChatList.Selected)
    def _chat_chosen(self, event: ChatList.Selected) -> None:
        event.stop()
        self.dismiss(event.chat_id)

    @on(ChatList.RenameRequested)
    @on(ChatList.DeleteRequested)
    def _pass_on(self, event: ChatList.RenameRequested | ChatList.DeleteRequested) -> None:
        event.stop()
        below = self.app.screen_stack[-2]
        below.post_message(type(event)(event.chat_id))

    def refresh_chats(self) -> None:
        self.query_one(ChatList).refresh_chats()

    def action_close(self) -> None:
        self.dismiss(None)


class GpuScreen(ModalScreen[None]):
    """Every GPU over the whole width: every field, in two lines a GPU (one line on a wide terminal)."""

    BINDINGS = [Binding("escape,f3", "close", "Close", id="overlay.close")]

    def __init__(self, readings: tuple[GpuReading, ...], problem: str | None) -> None:
        super().__init__(classes="overlay-screen")
        self.readings = readings
        self.problem = problem

    def compose(self) -> ComposeResult:
        with Vertical(classes="overlay"):
            yield Label("GPUs  [dim](Esc close)[/dim]", classes="dialog-title")
            panel = GpuPanel(title=False, id="overlay-gpu-panel")
            yield panel

    def on_mount(self) -> None:
        panel = self.query_one(GpuPanel)
        panel.problem = self.problem
        panel.readings = self.readings
        panel.watch(self.app, "gpu_readings", self._update)
        panel.watch(self.app, "gpu_stages", self._update_stages)

    def _update(self, readings: tuple[GpuReading, ...]) -> None:
        self.query_one(GpuPanel).readings = readings

    def _update_stages(self, stages: tuple[GpuStage, ...]) -> None:
        self.query_one(GpuPanel).stages = stages

    def action_close(self) -> None:
        self.dismiss(None)
