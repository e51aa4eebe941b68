"""Ctrl+I / Ctrl+O: choose an image file, with a preview (Kitty, Sixel or half-cell, as the terminal allows)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from PIL import Image as PILImage
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Static
from textual_image.widget import Image

from cmpchat.history.images import IMAGE_SUFFIXES


class ImageTree(DirectoryTree):
    """A directory tree showing folders and image files only, hidden ones left out."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [
            path
            for path in paths
            if not path.name.startswith(".") and (path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES)
        ]


class ImagePickerScreen(ModalScreen[Path | None]):
    """Browse from `start`; dismisses with the chosen image's path, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    def __init__(self, start: Path) -> None:
        super().__init__(classes="dialog-screen")
        self.start = start
        self.chosen: Path | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog picker-dialog"):
            yield Label("Attach an image", classes="dialog-title")
            with Horizontal(id="picker-body"):
                yield ImageTree(self.start, id="image-tree")
                with Vertical(id="preview-pane"):
                    yield Static("select an image to preview it", id="preview-caption", markup=False)
            yield Input(placeholder="or type a path and press Enter", id="image-path", compact=True)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Attach", variant="primary", id="attach", disabled=True, compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one(ImageTree).focus()

    @on(DirectoryTree.FileSelected)
    async def _file_selected(self, event: DirectoryTree.FileSelected) -> None:
        await self._preview(event.path)

    @on(Input.Submitted, "#image-path")
    async def _path_typed(self, event: Input.Submitted) -> None:
        path = Path(event.value).expanduser()
        if path.is_file():
            await self._preview(path)
            self._attach_chosen()
        else:
            self.query_one("#preview-caption", Static).update(f"no such file: {path}")

    @on(Button.Pressed, "#attach")
    def _attach_chosen(self) -> None:
        if self.chosen is not None:
            self.dismiss(self.chosen)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)

    async def _preview(self, path: Path) -> None:
        pane = self.query_one("#preview-pane", Vertical)
        for image in pane.query(Image):
            await image.remove()
        caption = self.query_one("#preview-caption", Static)
        try:
            with PILImage.open(path) as opened:
                opened.verify()
        except (OSError, SyntaxError, ValueError) as err:  # PIL's ways of saying "not an image"
            caption.update(f"{path.name}: not an image cmpchat can read ({err})")
            self.chosen = None
            self.query_one("#attach", Button).disabled = True
            return
        await pane.mount(Image(path, id="preview-image"), before=caption)
        caption.update(path.name)
        self.chosen = path
        attach = self.query_one("#attach", Button)
        attach.disabled = False
