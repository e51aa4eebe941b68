"""The top line: model, where it runs, context used, thinking state; and the demo model's warning."""

from __future__ import annotations

from textual.app import RenderResult
from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from cmpchat.tui.format import count, short_count


class TitleBar(Widget):
    """`cmpchat ─ model · 3 GPUs · ctx 18,204 / 262,144 ───── think: on ─ F1 help`, shortened when narrow."""

    model_name: reactive[str] = reactive("no model")
    device: reactive[str] = reactive("")
    context_used: reactive[int] = reactive(0)
    context_max: reactive[int] = reactive(0)
    thinking: reactive[bool] = reactive(True)
    chat_title: reactive[str] = reactive("")

    def render(self) -> RenderResult:
        width = self.size.width
        wide = width >= 120
        context = ""
        if self.context_max:
            if wide:
                context = f"ctx {count(self.context_used)} / {count(self.context_max)}"
            else:
                context = f"ctx {short_count(self.context_used)}/{short_count(self.context_max)}"
        left = " · ".join(part for part in (self.model_name, self.device, context) if part)
        if wide and self.chat_title:
            left += f" · {self.chat_title}"
        right = f"think: {'on' if self.thinking else 'off'} ─ F1 help"
        room = width - len("cmpchat ─ ") - len(right) - 3  # two spaces around the fill, at least one ─
        if len(left) > room:
            left = left[: max(room - 1, 0)] + "…"
        fill = "─" * max(room + 1 - len(left), 1)
        think_style = "$success" if self.thinking else "$text-muted"
        return (
            f"[b $primary]cmpchat[/] ─ {escape(left)} {fill} "
            f"[{think_style}]think: {'on' if self.thinking else 'off'}[/] ─ [$text-muted]F1 help[/]"
        )


class DemoBanner(Static):
    """Shown while the demo model is loaded: its weights are random, so is what it writes."""

    DEFAULT_CLASSES = "banner"

    def __init__(self) -> None:
        super().__init__(
            "[b]demo model[/b], random text: F4 or [b]cmpchat -m FILE.gguf[/b] loads a real model",
            id="demo-banner",
        )
