"""Progress lines on stderr for slow steps (building the demo model, loading), so nothing looks frozen."""

from __future__ import annotations

import sys
import time


class StderrProgress:
    """A `progress(stage, done, total)` callback that redraws one status line, at most 10 times a second."""

    def __init__(self) -> None:
        self._stage = ""
        self._last = 0.0
        self._live = sys.stderr.isatty()

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if stage == self._stage and not finished and now - self._last < 0.1:
            return
        self._last = now
        if self._live:
            percent = f" {100 * done // total:3d}%" if total > 1 else ""
            sys.stderr.write(f"\r\x1b[2K{stage}{percent}" + ("\n" if finished else ""))
        elif stage != self._stage:
            sys.stderr.write(f"{stage}...\n")
        sys.stderr.flush()
        self._stage = stage

    def close(self) -> None:
        if self._live:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
