"""Small modal dialogs: ask for one line of text, or confirm a choice."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class TextInputDialog(ModalScreen[str | None]):
    """A title, one input line, OK and Cancel; dismisses with the text, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    def __init__(self, title: str, value: str = "", *, hint: str = "", ok: str = "OK") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.value = value
        self.hint = hint
        self.ok = ok

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, id="dialog-input")
            if self.hint:
                yield Static(self.hint, classes="dialog-hint", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.ok, variant="primary", id="ok", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _accept(self) -> None:
        text = self.query_one("#dialog-input", Input).value.strip()
        self.dismiss(text or None)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """A question with a yes and a no button; dismisses with True for yes."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    def __init__(self, title: str, message: str, *, yes: str = "Yes", no: str = "Cancel") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.message = message
        self.yes = yes
        self.no = no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Static(self.message, classes="dialog-message")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, variant="warning", id="yes", compact=True)
                yield Button(self.no, id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#yes", Button).focus()

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def action_cancel(self) -> None:
        self.dismiss(False)
