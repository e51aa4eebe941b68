"""Rows per GPU, as nvitop lays them out: utilisation sparkline and percent, memory (and cmpchat's share),
temperature, fan, power, clocks, PCIe link and traffic, throttle reasons, and the pipeline stage the GPU holds
(`s0 L0-15 decode`: stage 0, layers 0 to 15, the engine decoding).

Three forms, by the panel's width:
- narrow (the side column, 33 columns): what moves, in two lines a GPU, and a third with the stage on a GPU that
  holds one; clocks, fan, link, cmpchat's memory and throttle reasons are left to the full-screen list (F3);
- wide (from `WIDE_WIDTH`, the full-screen list, 8 GPUs in 80×24): every field in two lines a GPU, aligned
  under a two-line header; the stage and the throttle reasons share what is left of the second line, the stage
  first, then as many reasons as fit ("+2" for the rest);
- one line (from `ONE_LINE_WIDTH`): the wide form's two lines side by side.
When the rows below the panel cannot hold its lines, the second tier goes (the stage lines when narrow, each
GPU's second line when wide) rather than GPUs falling off the bottom.

A field the driver does not report reads "–" (mining cards refuse several). Colours follow nvitop's
thresholds, so they read the same as there: utilisation and memory are light below 10 %, moderate below 75 %,
heavy above; temperature is warm from 75 °C and hot from 85 °C; power is high from 90 % of its limit.
Throttle reasons that slow the card are warnings (errors for the hardware's own), the benign ones muted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from textual.app import RenderResult
from textual.content import Content
from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from cmpchat.gpu_readings import GpuReading, GpuStage, stages_of
from cmpchat.tui.format import gigabytes, megabytes_per_second, sparkline

HISTORY = 32
"""Utilisation readings kept per GPU for the sparkline."""
WIDE_WIDTH = 64
ONE_LINE_WIDTH = 140
NAME_WIDTH = 12
"""Columns a card's name takes at most ("CMP 100-210"), once "NVIDIA " and the like are dropped."""
NAME_PREFIXES = ("NVIDIA ", "GeForce ", "Tesla ", "Quadro ")
THROTTLE_LABELS = {
    "idle": "idle",
    "app_clocks": "app-clk",
    "sw_power_cap": "pwr-cap",
    "hw_slowdown": "hw-slow",
    "sync_boost": "sync",
    "sw_thermal": "sw-therm",
    "hw_thermal": "hw-therm",
    "hw_power_brake": "pwr-brake",
    "display_clocks": "disp-clk",
    "board_limit": "board",
    "reliability": "reliab",
}
"""Short names of `cmpchat.gpu_readings.THROTTLE_REASONS`' reasons."""
BENIGN_THROTTLE = frozenset({"idle", "app_clocks", "sync_boost", "display_clocks"})
"""Reasons that hold the clocks down without slowing any work (an idle card, clocks an application chose)."""
HARDWARE_THROTTLE = frozenset({"hw_slowdown", "hw_thermal", "hw_power_brake"})
"""The board's own emergency brakes: a cooling or power supply problem."""
ACTIVITY_STYLES = {"idle": "$text-muted", "prefill": "$warning", "decode": "$success", "prefill+decode": "$accent"}
GAP = "  "
"""Between the wide form's columns."""
Column = tuple[str, int, bool]
"""A wide-form column: its header label, its width and whether it is right-aligned."""
FIRST_COLUMNS: list[Column] = [
    ("utilisation", 15, False),
    ("memory", 10, True),
    ("cmpchat", 7, True),
    ("temp", 4, True),
    ("fan", 4, True),
    ("power", 8, True),
]
"""The first line's columns after the index and the name."""
SECOND_COLUMNS: list[Column] = [("SM/mem MHz", 10, True), ("link", 7, True), ("PCIe rx/tx MB/s", 17, True)]
TAIL_LABEL = "stage · throttle"


class GpuPanel(Widget):
    """Shows the latest GPU readings and the stages each GPU holds; `problem` replaces them with one line when
    there are none."""

    readings: reactive[tuple[GpuReading, ...]] = reactive(())
    problem: reactive[str | None] = reactive(None)
    stages: reactive[tuple[GpuStage, ...]] = reactive(())
    """Every pipeline stage of the model, matched to the readings by `stages_of`; () when none are known (the
    CPU backend, a model loading, a server that does not say)."""

    def __init__(self, *, title: bool = True, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.show_title = title
        self._history: dict[int, deque[float]] = {}
        self._second_tier = True
        """Whether the rows below hold the stage lines (narrow) or each GPU's second line (wide)."""

    def reset_history(self) -> None:
        """Forget the utilisation history behind the sparklines (a new set of GPUs, or a fresh start)."""
        self._history.clear()
        self.refresh()

    def watch_readings(self, readings: tuple[GpuReading, ...]) -> None:
        if not readings:
            self._history.clear()  # the readings stopped or their source changed: older history is not theirs
        for reading in readings:
            history = self._history.setdefault(reading.index, deque(maxlen=HISTORY))
            if reading.utilization is not None:  # a card that does not say draws no line, not an idle one
                history.append(reading.utilization)
        self._fit_height()

    def watch_problem(self) -> None:
        self._fit_height()

    def watch_stages(self) -> None:
        self._fit_height()

    def on_resize(self) -> None:
        self._fit_height()

    def _form(self) -> str:
        width = self.size.width
        return "one line" if width >= ONE_LINE_WIDTH else "wide" if width >= WIDE_WIDTH else "narrow"

    def _line_count(self, second_tier: bool) -> int:
        form = self._form()
        if form == "narrow":
            held = sum(1 for r in self.readings if stages_of(r, self.stages)) if second_tier else 0
            return 1 + 2 * len(self.readings) + held  # the title, two lines a GPU, a stage line where held
        if form == "wide" and second_tier:
            return 3 + 2 * len(self.readings)  # the title, a two-line header, two lines a GPU
        return 2 + len(self.readings)  # the title, a header, a line a GPU

    def _room(self) -> int | None:
        """Rows from the panel's top to the bottom of its container; None before the first layout."""
        parent = self.parent
        if not isinstance(parent, Widget) or not self.region or not parent.content_region:
            return None
        return parent.content_region.bottom - self.region.y

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
            room = self._room()
            full = self._line_count(True) - (0 if self.show_title else 1)
            self._second_tier = room is None or full <= room
            lines = self._line_count(self._second_tier)
        lines -= 0 if self.show_title else 1
        if self.styles.height is None or self.styles.height.value != lines:
            self.styles.height = lines

    def render(self) -> RenderResult:
        lines = ["[b]GPUs[/b]"] if self.show_title else []
        if self.problem:
            lines.append(f"[$text-muted]{self.problem}[/]")
        elif not self.readings:
            lines.append("[$text-muted]reading GPUs…[/]")
        elif self._form() == "narrow":
            for reading in self.readings:
                lines += self._narrow(reading)
        else:
            lines += self._wide_lines(self._form() == "one line")
        return "\n".join(lines)

    def _narrow(self, r: GpuReading) -> list[str]:
        spark = self._spark(r, 6)
        first = f"{r.index} {spark} {_utilization(r)} {_memory(r, short=True)} {_temperature(r)}"
        rx, tx = megabytes_per_second(r.pcie_rx), megabytes_per_second(r.pcie_tx)
        second = f"  {_power(r)} [$text-muted]rx[/] {rx} [$text-muted]tx[/] {tx} [$text-muted]MB/s[/]"
        held = stages_of(r, self.stages)
        if not held or not self._second_tier:
            return [first, second]
        return [first, second, f"  {stage_markup(held)}"]

    def _wide_lines(self, one_line: bool) -> list[str]:
        """The header and every GPU's lines in the wide or the one-line form, columns aligned over all GPUs."""
        index_width = max(len(str(r.index)) for r in self.readings)
        first_columns = [
            ("name", max(len(short_name(r.name)) for r in self.readings), False),
            *FIRST_COLUMNS,
        ]
        indent = " " * (index_width + 1)
        first_header = "#".rjust(index_width) + " " + _header(first_columns)
        second_header = _header(SECOND_COLUMNS) + GAP + TAIL_LABEL
        if one_line:
            lines = [f"[$text-muted]{first_header}{GAP}{second_header}[/]"]
        else:
            lines = [f"[$text-muted]{first_header}[/]"]
            if self._second_tier:
                lines.append(f"[$text-muted]{indent}{second_header}[/]")
        for r in self.readings:
            first = (
                str(r.index).rjust(index_width)
                + " "
                + _row(
                    [
                        escape(short_name(r.name)),
                        f"{self._spark(r, 10)} {_utilization(r)}",
                        _memory(r, short=False),
                        _cmpchat_memory(r),
                        _temperature(r),
                        _fan(r),
                        _power(r),
                    ],
                    first_columns,
                )
            )
            second = _row([_clocks(r), _link(r), _traffic(r)], SECOND_COLUMNS) + GAP
            lead = first + GAP + second if one_line else indent + second
            room = self.size.width - _plain_width(lead)
            line = lead + _tail(stages_of(r, self.stages), r.throttle_reasons, room)
            if one_line:
                lines.append(line)
            else:
                lines.append(first)
                if self._second_tier:
                    lines.append(line)
        return lines

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


def _cmpchat_memory(r: GpuReading) -> str:
    return "–" if r.memory_cmpchat is None else f"{gigabytes(r.memory_cmpchat)}G"


def _fan(r: GpuReading) -> str:
    return "–" if r.fan is None else f"{r.fan}%"


def _clocks(r: GpuReading) -> str:
    if r.sm_clock is None and r.memory_clock is None:
        return "–"
    return f"{_or_dash(r.sm_clock)}/{_or_dash(r.memory_clock)}"


def _link(r: GpuReading) -> str:
    """`Gen1x1`: the link's generation and lane count now (a CMP 100-210 runs Gen1 x1)."""
    if r.pcie_generation is None and r.pcie_width is None:
        return "–"
    return f"Gen{_or_dash(r.pcie_generation)}x{_or_dash(r.pcie_width)}"


def _traffic(r: GpuReading) -> str:
    rx, tx = megabytes_per_second(r.pcie_rx), megabytes_per_second(r.pcie_tx)
    return f"[$text-muted]rx[/] {rx:>5} [$text-muted]tx[/] {tx:>5}"


def _or_dash(value: int | None) -> str:
    return "–" if value is None else str(value)


def short_name(name: str) -> str:
    """A card's name without the vendor's and product line's words, at most `NAME_WIDTH` columns:
    "NVIDIA CMP 100-210" -> "CMP 100-210", "NVIDIA GeForce RTX 4090" -> "RTX 4090"."""
    for prefix in NAME_PREFIXES:
        name = name.removeprefix(prefix)
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"


def spans(ranges: Sequence[range]) -> str:
    """Ranges as inclusive spans, touching ones merged: [0..15], [16..31] -> "0-31"; [0..15], [32..47] ->
    "0-15,32-47"; a single number stands alone."""
    merged: list[list[int]] = []
    for part in sorted((r for r in ranges if len(r)), key=lambda r: r.start):
        if merged and part.start <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], part.stop - 1)
        else:
            merged.append([part.start, part.stop - 1])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in merged)


def stage_markup(held: Sequence[GpuStage]) -> str:
    """`s0 L0-15 decode`: the stages a GPU holds, their layers and what the engine does (the same on all)."""
    work = held[0].activity
    stages = spans([range(stage.stage, stage.stage + 1) for stage in held])
    layers = spans([stage.layers for stage in held])
    return f"s{stages} L{layers} [{ACTIVITY_STYLES.get(work, '$foreground')}]{work}[/]"


def throttle_markup(reason: str) -> str:
    style = "$text-muted" if reason in BENIGN_THROTTLE else "$error" if reason in HARDWARE_THROTTLE else "$warning"
    return f"[{style}]{THROTTLE_LABELS.get(reason, reason)}[/]"


def _throttle_rank(reason: str) -> int:
    return 0 if reason in HARDWARE_THROTTLE else 2 if reason in BENIGN_THROTTLE else 1


def _tail(held: Sequence[GpuStage], throttle: tuple[str, ...] | None, room: int) -> str:
    """The wide form's last column: the stage ("–" on a GPU holding none), then the throttle reasons that fit
    in `room` columns, the hardware's first and the benign last ("+N" for the rest; "–" when the driver does not
    say, nothing when none hold the clocks)."""
    tail = stage_markup(held) if held else "[$text-muted]–[/]"
    if throttle is None:
        return f"{tail} [$text-muted]·[/] –"
    if not throttle:
        return tail
    throttle = tuple(sorted(throttle, key=_throttle_rank))  # what slows the card most first: cut last
    left = room - _plain_width(tail) - 3  # " · "

    def words(shown: int) -> list[str]:
        hidden = len(throttle) - shown
        return [THROTTLE_LABELS.get(reason, reason) for reason in throttle[:shown]] + ([f"+{hidden}"] if hidden else [])

    shown = len(throttle)
    while shown and len(" ".join(words(shown))) > left:
        shown -= 1
    reasons = [throttle_markup(reason) for reason in throttle[:shown]] + words(shown)[shown:]
    return f"{tail} [$text-muted]·[/] {' '.join(reasons)}"


def _plain_width(markup: str) -> int:
    return Content.from_markup(markup).cell_length


def _header(columns: Sequence[Column]) -> str:
    return GAP.join(label.rjust(width) if right else label.ljust(width) for label, width, right in columns)


def _row(cells: Sequence[str], columns: Sequence[Column]) -> str:
    """Markup cells padded to their columns' widths (by what they show, not their markup)."""
    padded = []
    for cell, (_, width, right) in zip(cells, columns, strict=True):
        pad = " " * max(0, width - _plain_width(cell))
        padded.append(pad + cell if right else cell + pad)
    return GAP.join(padded)
