"""The per-chat settings dialog: system prompt and sampling."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from cmpchat.tui.settings import ChatOptions

_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("temperature", "temperature", "0 = greedy"),
    ("top_p", "top p", "1 = off"),
    ("top_k", "top k", "0 = all"),
    ("max_tokens", "max tokens", "per reply"),
    ("seed", "seed", "empty = random"),
)


class ChatSettingsScreen(ModalScreen[ChatOptions | None]):
    """Edits a copy of the chat's options; dismisses with the new ones, or None when cancelled."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="dialog.cancel"),
        Binding("ctrl+s", "save", "Save", id="dialog.save", priority=True),
    ]

    def __init__(self, options: ChatOptions, chat_title: str) -> None:
        super().__init__(classes="dialog-screen")
        self.options = options
        self.chat_title = chat_title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide-dialog"):
            yield Label(f"Settings of “{self.chat_title}”", classes="dialog-title")
            yield Label("System prompt", classes="field-label")
            yield TextArea(self.options.system_prompt, id="system-prompt", soft_wrap=True, compact=True)
            with Grid(id="sampling-grid"):
                for name, label, hint in _FIELDS:
                    value = getattr(self.options, name)
                    yield Label(label, classes="field-label")
                    yield Input("" if value is None else str(value), id=name, compact=True, placeholder=hint)
            yield Static("", id="settings-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#system-prompt", TextArea).focus()

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            options = self._read()
        except ValueError as err:
            self.query_one("#settings-error", Static).update(str(err))
            return
        self.dismiss(options)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)

    def _read(self) -> ChatOptions:
        def value(name: str) -> str:
            return self.query_one(f"#{name}", Input).value.strip()

        try:
            seed = int(value("seed")) if value("seed") else None
            options = ChatOptions(
                system_prompt=self.query_one("#system-prompt", TextArea).text,
                temperature=float(value("temperature")),
                top_p=float(value("top_p")),
                top_k=int(value("top_k")),
                max_tokens=int(value("max_tokens")),
                seed=seed,
            )
        except ValueError:
            raise ValueError("temperature and top p are numbers; top k, max tokens and seed whole numbers") from None
        options.generation_options()  # raises ValueError with the engine's own wording for bad values
        return options
