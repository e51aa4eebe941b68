"""The UI-side state of the one reply being generated: where its text goes, how long it thought, and the
speed figures derived from its progress reports."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from cmpchat.history.store import MessageRecord, MessageStatus
from cmpchat.tui.reply_stream import ReplyBuffer, ReplyUpdate
from cmpchat.tui.widgets.messages import ReplyView
from cmpchat.tui.widgets.speed_panel import SpeedStats

SPARK_SECONDS = 0.25
"""How often a decode speed sample is added to the sparkline."""
SPARK_SAMPLES = 64
UI_SHARE = 0.02
"""Most of one core the UI thread may use while a reply streams. Generation runs on a thread of the same
process: every millisecond the UI holds the GIL is a millisecond the engine may wait, so screen updates
are spaced to keep the app's own work near this share, whatever a frame costs on this machine."""
SLOWEST_UPDATE = 1.0
"""Seconds between screen updates at the most, however slow the machine."""


class UpdatePacer:
    """Decides when the next screen update of a streaming reply is due.

    After each update it looks at the CPU time the UI thread used since the previous one (the update,
    the frame it drew, anything else the app did) and waits long enough for that to be `UI_SHARE` of
    the time: a cheap frame allows `fastest` updates a second, an expensive one fewer.
    """

    def __init__(self, fastest: float) -> None:
        self.fastest = fastest
        self.interval = fastest
        self._cpu = time.thread_time()

    def next_interval(self) -> float:
        cpu = time.thread_time()
        used, self._cpu = cpu - self._cpu, cpu
        self.interval = min(max(used / UI_SHARE, self.fastest), SLOWEST_UPDATE)
        return self.interval


@dataclass(slots=True)
class ReplyRun:
    """One reply in flight. `cancel` is what Esc sets; the worker thread sees it after the current step."""

    record: MessageRecord
    view: ReplyView
    limit: int
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    cancel: threading.Event = field(default_factory=threading.Event)
    pacer: UpdatePacer = field(default_factory=lambda: UpdatePacer(1 / 30))
    stopped_by_user: bool = False
    saved_at: float = 0.0
    """When the partial reply was last written to history."""
    reasoning_started: float | None = None
    reasoning_ended: float | None = None
    _sample_time: float = field(default_factory=time.perf_counter)
    _sample_tokens: int = 0

    def stop(self) -> None:
        self.stopped_by_user = True
        self.cancel.set()

    @property
    def reasoning_seconds(self) -> float:
        if self.reasoning_started is None:
            return 0.0
        return (self.reasoning_ended or time.perf_counter()) - self.reasoning_started

    def note_text(self, update: ReplyUpdate) -> bool:
        """Track when reasoning starts and ends; True when this update ends it (time to fold it away)."""
        now = time.perf_counter()
        if update.reasoning and self.reasoning_started is None:
            self.reasoning_started = now
        if (
            (update.content or update.tool_calls)
            and self.reasoning_started is not None
            and self.reasoning_ended is None
        ):
            self.reasoning_ended = now
            return True
        return False

    def final_status(self, update: ReplyUpdate) -> MessageStatus:
        if update.error is not None:
            return "interrupted" if update.cut else "error"
        if update.finished is not None and update.finished.reason == "cancelled":
            return "stopped" if self.stopped_by_user else "interrupted"
        return "complete"

    def speed(self, update: ReplyUpdate, stats: SpeedStats) -> SpeedStats:
        """`stats` moved on by one update (progress, first token, sparkline sample)."""
        changes: dict[str, object] = {}
        if update.prompt is not None:
            p = update.prompt
            changes.update(prompt_done=p.done, prompt_total=p.total, prompt_rate=p.tokens_per_second)
            changes["context_used"] = p.total
            if p.done < p.total:
                changes["phase"] = "prompt"
        if update.first_token_seconds is not None:
            changes["first_token_seconds"] = update.first_token_seconds
        if update.decode is not None:
            d = update.decode
            changes.update(decode_rate=d.tokens_per_second, generated=d.generated_tokens, phase="generating")
            changes["context_used"] = (
                update.prompt.total if update.prompt else stats.prompt_total
            ) + d.generated_tokens
            now = time.perf_counter()
            if now - self._sample_time >= SPARK_SECONDS:
                recent = (d.generated_tokens - self._sample_tokens) / (now - self._sample_time)
                changes["decode_history"] = (*stats.decode_history, recent)[-SPARK_SAMPLES:]
                self._sample_time, self._sample_tokens = now, d.generated_tokens
        if self.stopped_by_user and not update.done:
            changes["phase"] = "stopped"
        return replace(stats, **changes) if changes else stats  # type: ignore[arg-type]
