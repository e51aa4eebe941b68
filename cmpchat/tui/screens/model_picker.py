"""F4 (and the first start): pick a GGUF found on this machine, the demo model, or type a path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from cmpchat.model.discovery import FoundModel
from cmpchat.tui.format import file_size
from cmpchat.tui.model_request import ModelRequest

_DEMO = "demo"


class ModelPickerScreen(ModalScreen[ModelRequest | None]):
    """Lists models found by `discover` (run on a thread: it walks folders); dismisses with the choice."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    def __init__(self, discover: Callable[[], list[FoundModel]], *, can_cancel: bool = True) -> None:
        super().__init__(classes="dialog-screen")
        self.discover = discover
        self.can_cancel = can_cancel
        self.found: list[FoundModel] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog picker-dialog"):
            yield Label("Choose a model", classes="dialog-title")
            yield Static("looking for GGUF files…", id="model-status", markup=False)
            yield OptionList(id="model-list")
            yield Input(placeholder="or type the path of a .gguf file and press Enter", id="model-path", compact=True)

    def on_mount(self) -> None:
        self._discover()

    @work(thread=True, exclusive=True, group="discover")
    def _discover(self) -> None:
        found = self.discover()
        self.app.call_from_thread(self._show, found)

    def _show(self, found: list[FoundModel]) -> None:
        self.found = found
        options = self.query_one("#model-list", OptionList)
        options.clear_options()
        for index, model in enumerate(found):
            options.add_option(_option(model, index))
            options.add_option(None)
        options.add_option(
            Option(
                Text.assemble(("demo model", "bold"), ("  random weights: its replies are random text", "dim")),
                id=_DEMO,
            )
        )
        supported = sum(model.supported for model in found)
        status = (
            f"{supported} model{'s' if supported != 1 else ''} cmpchat can run, found in the llama.cpp, Hugging Face "
            "and LM Studio caches, ~/models and model_dirs"
            if found
            else "no GGUF files found in the llama.cpp, Hugging Face or LM Studio caches, ~/models or model_dirs"
        )
        self.query_one("#model-status", Static).update(status)
        options.highlighted = 0
        options.focus()

    @on(OptionList.OptionSelected, "#model-list")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id == _DEMO:
            self.dismiss(ModelRequest(None))
            return
        model = self.found[int(event.option.id or 0)]
        self.dismiss(ModelRequest(model.path, model.projector))

    @on(Input.Submitted, "#model-path")
    def _typed(self, event: Input.Submitted) -> None:
        path = Path(event.value.strip()).expanduser()
        if path.is_file():
            self.dismiss(ModelRequest(path))
        else:
            self.query_one("#model-status", Static).update(f"no such file: {path}")

    def action_cancel(self) -> None:
        if self.can_cancel:
            self.dismiss(None)


def _option(model: FoundModel, index: int) -> Option:
    label = Text.assemble((model.name, "bold"), f"  {file_size(model.size)}  ", (model.source, "dim"))
    if model.projector is not None:
        label.append("  + vision projector", style="italic")
    label.append(f"\n{model.path}", style="dim")
    if not model.supported:
        label.append(
            f"\narchitecture {model.architecture or 'unknown'}: cmpchat runs Qwen3.5/3.6 dense (qwen35)", style="dim"
        )
    return Option(label, id=str(index), disabled=not model.supported)
