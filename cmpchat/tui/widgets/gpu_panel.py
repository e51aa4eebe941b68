"""One compact row per GPU: utilisation sparkline and percent, memory, temperature, power, PCIe traffic.

Two lines per GPU when the panel is narrow (the right column), one line when it has 64 columns or more
(the full-screen overlay: 8 GPUs fit in 80×24). Colours follow nvitop's thresholds, so they read the
same as there: utilisation and memory are light below 10 %, moderate below 75 %, heavy above;
temperature is warm from 75 °C and hot from 85 °C; power is high from 90 % of its limit.
"""

from __future__ import annotations

from collections import deque

from textual.app import RenderResult
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from cmpchat.gpu_readings import GpuReading
from cmpchat.tui.format import gigabytes, megabytes_per_second, sparkline

HISTORY = 32
"""Utilisation readings kept per GPU for the sparkline."""
ONE_LINE_WIDTH = 64
ONE_LINE_HEADER = "# utilisation        memory    temp  power          PCIe traffic"


class GpuPanel(Widget):
    """Shows the latest GPU readings; `problem` replaces them with one line when there are none."""

    readings: reactive[tuple[GpuReading, ...]] = reactive(())
    problem: reactive[str | None] = reactive(None)

    def __init__(self, *, title: bool = True, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.show_title = title
        self._history: dict[int, deque[float]] = {}

    def reset_history(self) -> None:
        """Forget the utilisation history behind the sparklines (a new set of GPUs, or a fresh start)."""
        self._history.clear()
        self.refresh()

    def watch_readings(self, readings: tuple[GpuReading, ...]) -> None:
        if not readings:
            self._history.clear()  # the readings stopped or their source changed: older history is not theirs
        for reading in readings:
            history = self._history.setdefault(reading.index, deque(maxlen=HISTORY))
            history.append(reading.utilization or 0.0)
        self._fit_height()

    def watch_problem(self) -> None:
        self._fit_height()

    def on_resize(self) -> None:
        self._fit_height()

    def _fit_height(self) -> None:
        # A fixed height, changed only when the line count does: a new reading every second must
        # repaint the panel, not lay out the whole screen again.
        if self.problem:
            # A problem is one sentence and wraps in the side column: every line of it must fit.
            width = self.content_size.width
            lines = 1 + (len(Content(self.problem).wrap(width)) if width > 0 else 1)
        elif not self.readings:
            lines = 2
        else:
            one_line = self.size.width >= ONE_LINE_WIDTH
            lines = len(self.readings) * (1 if one_line else 2) + 1 + one_line
        lines -= 0 if self.show_title else 1
        if self.styles.height is None or self.styles.height.value != lines:
            self.styles.height = lines

    def render(self) -> RenderResult:
        lines = ["[b]GPUs[/b]"] if self.show_title else []
        if self.problem:
            lines.append(f"[$text-muted]{self.problem}[/]")
        elif not self.readings:
            lines.append("[$text-muted]reading GPUs…[/]")
        else:
            one_line = self.size.width >= ONE_LINE_WIDTH
            if one_line:
                lines.append(f"[$text-muted]{ONE_LINE_HEADER}[/]")
            for reading in self.readings:
                lines += self._one_line(reading) if one_line else self._two_lines(reading)
        return "\n".join(lines)

    def _two_lines(self, r: GpuReading) -> list[str]:
        spark = self._spark(r, 6)
        first = f"{r.index} {spark} {_utilization(r)} {_memory(r, short=True)} {_temperature(r)}"
        rx, tx = megabytes_per_second(r.pcie_rx), megabytes_per_second(r.pcie_tx)
        second = f"  {_power(r)} [$text-muted]rx[/] {rx} [$text-muted]tx[/] {tx} [$text-muted]MB/s[/]"
        return [first, second]

    def _one_line(self, r: GpuReading) -> list[str]:
        spark = self._spark(r, 10)
        rx, tx = megabytes_per_second(r.pcie_rx), megabytes_per_second(r.pcie_tx)
        return [
            f"{r.index} {spark} {_utilization(r)}  {_memory(r, short=False)}  {_temperature(r)}  {_power(r)}"
            f"  [$text-muted]PCIe rx[/] {rx:>5} [$text-muted]tx[/] {tx:>5} [$text-muted]MB/s[/]"
        ]

    def _spark(self, r: GpuReading, width: int) -> str:
        return f"[$accent]{sparkline(self._history.get(r.index, ()), width, top=100.0)}[/]"


def summary(readings: tuple[GpuReading, ...]) -> str:
    """`GPU 97/95/94% · 43.1/48 GB` for the narrow status bar; empty when there are no readings."""
    if not readings:
        return ""
    loads = "/".join("–" if r.utilization is None else f"{r.utilization:.0f}" for r in readings)
    used = sum(r.memory_used or 0 for r in readings)
    total = sum(r.memory_total or 0 for r in readings)
    memory = f" · {used / 2**30:.1f}/{total / 2**30:.0f} GB" if total else ""
    return f"GPU {loads}%{memory}"


def _load_style(percent: float | None) -> str:
    if percent is None:
        return "$text-muted"
    if percent < 10:
        return "$success"
    return "$warning" if percent < 75 else "$error"


def _utilization(r: GpuReading) -> str:
    value = "  –%" if r.utilization is None else f"{r.utilization:3.0f}%"
    return f"[{_load_style(r.utilization)}]{value}[/]"


def _memory(r: GpuReading, *, short: bool) -> str:
    if r.memory_used is None or not r.memory_total:
        return "–/–G"
    total = f"{r.memory_total / 2**30:.0f}" if short else gigabytes(r.memory_total)
    style = _load_style(100 * r.memory_used / r.memory_total)
    return f"[{style}]{gigabytes(r.memory_used):>4}[/]/{total}G"


def _temperature(r: GpuReading) -> str:
    if r.temperature is None:
        return " –°"
    style = "$error" if r.temperature >= 85 else "$warning" if r.temperature >= 75 else "$foreground"
    return f"[{style}]{r.temperature:>2}°[/]"


def _power(r: GpuReading) -> str:
    if r.power is None:
        return "   –W"
    limit = f"/{r.power_limit:.0f}" if r.power_limit else ""
    high = r.power_limit and r.power >= 0.9 * r.power_limit
    return f"[{'$warning' if high else '$foreground'}]{r.power:>3.0f}{limit}W[/]"
