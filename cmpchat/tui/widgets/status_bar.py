"""The one-line status bar that stands in for the right panel on narrow terminals."""

from __future__ import annotations

from textual.app import RenderResult
from textual.reactive import reactive
from textual.widget import Widget

from cmpchat.gpu_readings import GpuReading
from cmpchat.tui.format import count, rate, short_count
from cmpchat.tui.widgets.gpu_panel import summary
from cmpchat.tui.widgets.speed_panel import SpeedStats


class StatusBar(Widget):
    """`generating · 27.4 tok/s · prompt 812 tok/s · GPU 97/95/94% · 43.1/48 GB · ctx 18K/256K`."""

    stats: reactive[SpeedStats] = reactive(SpeedStats)
    readings: reactive[tuple[GpuReading, ...]] = reactive(())

    def render(self) -> RenderResult:
        s = self.stats
        if s.phase == "loading":
            percent = f" {s.load_fraction:.0%}" if s.load_fraction is not None else ""
            parts = [f"[$warning]loading[/]{percent} {s.load_stage}"]
        elif s.phase == "prompt" and s.prompt_total:
            left = s.prompt_seconds_left
            eta = f" · ~{left:.0f} s left" if left is not None else ""
            parts = [
                f"[$warning]prompt[/] {count(s.prompt_done)} / {count(s.prompt_total)} · {rate(s.prompt_rate)} tok/s{eta}"
            ]
        else:
            # Columns are scarce: the phase is a coloured mark, named only when something went wrong.
            marks = {
                "generating": "[$success]●[/] ",
                "stopped": "[$warning]■ stopped[/] ",
                "error": "[$error]error[/] ",
            }
            parts = [
                f"{marks.get(s.phase, '')}[b]{rate(s.decode_rate)}[/b] tok/s",
                f"prompt {rate(s.prompt_rate)} tok/s",
            ]
        gpus = summary(self.readings)
        if gpus:
            parts.append(gpus)
        if s.context_max:
            parts.append(f"ctx {short_count(s.context_used)}/{short_count(s.context_max)}")
        return " · ".join(parts)
