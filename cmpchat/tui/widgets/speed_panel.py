"""The live speed panel (right side on wide terminals) and the figures behind it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from textual.app import RenderResult
from textual.reactive import reactive
from textual.widget import Widget

from cmpchat.tui.format import count, rate, seconds, sparkline

Phase = Literal["starting", "loading", "idle", "prompt", "generating", "stopped", "error"]

PHASE_LABELS: dict[Phase, str] = {
    "starting": "starting",
    "loading": "loading",
    "idle": "idle",
    "prompt": "processing prompt",
    "generating": "generating",
    "stopped": "stopped",
    "error": "error",
}


@dataclass(frozen=True, slots=True)
class SpeedStats:
    """Everything the speed panel and the narrow status bar show. Speeds are tokens per second."""

    phase: Phase = "starting"
    load_stage: str = ""
    load_fraction: float | None = None
    prompt_done: int = 0
    prompt_total: int = 0
    prompt_rate: float | None = None
    decode_rate: float | None = None
    decode_history: tuple[float, ...] = ()
    """Recent decode speeds, a few a second, for the sparkline."""
    first_token_seconds: float | None = None
    generated: int = 0
    limit: int = 0
    context_used: int = 0
    context_max: int = 0

    @property
    def prompt_seconds_left(self) -> float | None:
        if not self.prompt_rate or self.prompt_total <= self.prompt_done:
            return None
        return (self.prompt_total - self.prompt_done) / self.prompt_rate


class SpeedPanel(Widget):
    """Phase, decode speed with a sparkline, prompt speed, time to first token, tokens and context."""

    stats: reactive[SpeedStats] = reactive(SpeedStats)

    def render(self) -> RenderResult:
        # Always seven lines, so an update repaints the panel without laying out the screen again.
        s = self.stats
        width = max(self.size.width, 20)
        label = 12
        phase = PHASE_LABELS[s.phase]
        if s.phase == "loading":
            percent = f" {s.load_fraction:.0%}" if s.load_fraction is not None else ""
            status = f"[$warning]{phase}[/]{percent} [$text-muted]{s.load_stage}[/]"
        else:
            spark = sparkline(s.decode_history, max(width - len(phase) - 2, 4))
            status = f"[{_phase_style(s.phase)}]{phase}[/] [$accent]{spark}[/]"
        if s.phase == "prompt" and s.prompt_total:
            left = s.prompt_seconds_left
            eta = f" · ~{left:.0f} s left" if left is not None else ""
            prompt_lines = [
                f"{'prompt':<{label}}{count(s.prompt_done)} / {count(s.prompt_total)}",
                f"{'':<{label}}{rate(s.prompt_rate)} tok/s{eta}",
            ]
        else:
            prompt_lines = [
                f"{'prompt':<{label}}{rate(s.prompt_rate)} tok/s",
                f"{'first token':<{label}}{seconds(s.first_token_seconds)}",
            ]
        limit = f" / {count(s.limit)}" if s.limit else ""
        context = f"{count(s.context_used)} / {count(s.context_max)}" if s.context_max else "–"
        lines = [
            "[b]Speed[/b]",
            status,
            f"{'decode':<{label}}[b]{rate(s.decode_rate)}[/b] tok/s",
            *prompt_lines,
            f"{'tokens':<{label}}{count(s.generated)}{limit}",
            f"{'context':<{label}}{context}",
        ]
        return "\n".join(lines)


def _phase_style(phase: Phase) -> str:
    return {"generating": "$success", "prompt": "$warning", "error": "$error", "stopped": "$warning"}.get(
        phase, "$text-muted"
    )
