"""F1: every key binding with its id (for the keymap in config.toml) and where settings live."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from cmpchat.tui.slash_commands import command_list


def binding_rows(bindings: Iterable[BindingType], keymap: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(keys, what, id) for every binding with an id, with the keymap's overrides applied."""
    rows = []
    for binding in bindings:
        if not isinstance(binding, Binding) or not binding.id:
            continue
        keys = keymap.get(binding.id, binding.key)
        rows.append((pretty_keys(keys), str(binding.tooltip or binding.description or binding.action), binding.id))
    return rows


class HelpScreen(ModalScreen[None]):
    """The key table; Esc, F1 or q closes it."""

    BINDINGS = [Binding("escape,f1,q", "close", "Close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str, str]], config_file: str) -> None:
        super().__init__(classes="dialog-screen")
        self.rows = rows
        self.config_file = config_file

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help-dialog"):
            yield Label("Keys", classes="dialog-title")
            table: DataTable[str | Text] = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("keys", "what", "id in keymap")
            for keys, what, binding_id in self.rows:
                # One key per line keeps the column narrow enough for the ids to fit in 80 columns.
                table.add_row(
                    Text(keys.replace(", ", "\n"), style="bold"), what, Text(binding_id, style="dim"), height=None
                )
            yield table
            yield Static(
                f'Change keys in {self.config_file} under [keymap], e.g. "chat.export" = "ctrl+x,f10". '
                "Ctrl+P opens the command palette (themes, and every action). "
                f"In the message box, / starts a command: {command_list()}.",
                classes="dialog-hint",
                markup=False,
            )

    def action_close(self) -> None:
        self.dismiss(None)


_NAMES = {
    "ctrl": "Ctrl",
    "alt": "Alt",
    "shift": "Shift",
    "escape": "Esc",
    "enter": "Enter",
    "delete": "Del",
    "slash": "/",
    "up": "Up",
    "down": "Down",
    "tab": "Tab",
}


def pretty_keys(keys: str) -> str:
    """ "ctrl+j,alt+enter" -> "Ctrl+J, Alt+Enter"."""
    pretty = []
    for key in keys.split(","):
        parts = [_NAMES.get(part, part.upper() if len(part) <= 3 else part) for part in key.strip().split("+")]
        pretty.append("+".join(parts))
    return ", ".join(pretty)
