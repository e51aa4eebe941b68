"""Loading a pipeline's stages: the stages of one GPU one after another, the GPUs all at once.

Each card has its own PCIe link, and a CMP 100-210's is Gen1 x1 (about 250 MB/s): 27B Q8_0 over three cards takes
about two minutes to upload one card after another and a third of that when every card uploads at once. Stages on
one GPU share its link, so they load in turn, on one thread (a GPU's context is never used by two loading threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cmpchat.backends.base import Progress

if TYPE_CHECKING:
    from cmpchat.backends.gpu.stage import Stage


@dataclass(frozen=True)
class StageLoad:
    """How to load one stage: `load(on_upload=...)` uploads it, calling `on_upload(bytes)` as its weights go up."""

    gpu: int
    label: str
    """What its progress says when its GPU loads alone."""
    weight_bytes: int
    load: Callable[..., Stage]


def load_stages(loads: Sequence[StageLoad], progress: Progress | None) -> list[Stage]:
    """Every stage, in order. With one GPU, on this thread, each stage's upload reported under its own label;
    with several, a thread a GPU and one progress line for all of them (`SharedUploads`). A stage that fails
    raises here once every GPU's thread has stopped (the first failure in stage order)."""
    by_gpu: dict[int, list[int]] = {}
    for index, load in enumerate(loads):
        by_gpu.setdefault(load.gpu, []).append(index)
    stages: list[Stage | None] = [None] * len(loads)
    if len(by_gpu) == 1:
        for index, load in enumerate(loads):
            uploads = UploadProgress(load.label, load.weight_bytes, progress)
            stages[index] = load.load(on_upload=uploads)
            uploads.finish()
    else:
        totals = {gpu: sum(loads[i].weight_bytes for i in indices) for gpu, indices in by_gpu.items()}
        shared = SharedUploads(totals, progress)

        def load_gpu(gpu: int) -> None:
            for index in by_gpu[gpu]:
                stages[index] = loads[index].load(on_upload=shared.reporter(gpu))

        with ThreadPoolExecutor(len(by_gpu), thread_name_prefix="cmpchat-upload") as pool:
            futures = [pool.submit(load_gpu, gpu) for gpu in by_gpu]
        for future in futures:
            future.result()
        shared.finish()
    assert all(stage is not None for stage in stages)
    return [stage for stage in stages if stage is not None]


class UploadProgress:
    """Reports one stage's weight upload as `progress(label, bytes so far, total)`."""

    def __init__(self, label: str, total: int, progress: Progress | None) -> None:
        self.label, self.total, self.progress, self.done = label, total, progress, 0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.label, min(self.done, self.total), self.total)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.label, self.total, self.total)


class SharedUploads:
    """One progress line for several GPUs uploading at once: the bytes of all of them, and each GPU's share done in
    the label, in steps of 10% (a label that changed on every report would print a line each time where the
    output is not a terminal). Reports come from the loading threads; they reach `progress` one at a time."""

    def __init__(self, totals: dict[int, int], progress: Progress | None) -> None:
        self._totals = totals
        self._done = dict.fromkeys(totals, 0)
        self._progress = progress
        self._lock = threading.Lock()

    def reporter(self, gpu: int) -> Callable[[int], None]:
        """The upload callback of `gpu`'s stages."""

        def report(nbytes: int) -> None:
            with self._lock:
                self._done[gpu] += nbytes
                self._report()

        return report

    def finish(self) -> None:
        with self._lock:
            self._done = dict(self._totals)
            self._report()

    def label(self) -> str:
        shares = ", ".join(
            f"GPU {gpu} {min(100, 100 * self._done[gpu] // max(total, 1)) // 10 * 10}%"
            for gpu, total in self._totals.items()
        )
        return f"loading weights onto {len(self._totals)} GPUs at once ({shares})"

    def _report(self) -> None:
        if self._progress is not None:
            total = sum(self._totals.values())
            self._progress(self.label(), min(sum(self._done.values()), total), total)
