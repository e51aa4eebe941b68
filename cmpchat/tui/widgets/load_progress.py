"""What the screen shows while a model loads (or the demo model is built): stage, bar, time so far."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, ProgressBar


class LoadProgress(Vertical):
    """Stage name, a progress bar (indeterminate when the stage has no count) and seconds elapsed.

    The elapsed time ticks on its own, so a long stage without progress reports never looks frozen.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._started = time.monotonic()
        self._stage = "starting"
        self._what = "the model"

    def compose(self) -> ComposeResult:
        yield Label("", id="load-title")
        yield ProgressBar(total=None, show_eta=False, id="load-bar")

    def on_mount(self) -> None:
        self._clock = self.set_interval(0.5, self._render_title, pause=True)

    def start(self, what: str) -> None:
        """Show the panel and start its clock."""
        self._started = time.monotonic()
        self._what = what
        self.display = True
        self._clock.resume()
        self.update_progress("opening", 0, 0)

    def stop(self) -> None:
        """Hide the panel and stop its clock and the bar's animation: an indeterminate bar redraws itself
        15 times a second, hidden or not, and that was GIL time taken from the engine all along a reply."""
        self.display = False
        self._clock.pause()
        self.query_one("#load-bar", ProgressBar).update(total=1, progress=1)

    def update_progress(self, stage: str, done: int, total: int) -> None:
        self._stage = stage
        bar = self.query_one("#load-bar", ProgressBar)
        if total > 1:
            bar.update(total=total, progress=done)
        else:
            bar.update(total=None)
        self._render_title()

    def _render_title(self) -> None:
        elapsed = time.monotonic() - self._started
        self.query_one("#load-title", Label).update(f"Loading {self._what}: {self._stage}… {elapsed:.0f} s")
