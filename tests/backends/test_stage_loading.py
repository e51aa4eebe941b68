"""Loading a pipeline's stages: a GPU's stages in turn on one thread, the GPUs at once, one progress line for all."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cmpchat.backends.gpu.stage_loading import StageLoad, load_stages


def loads_on(gpus: list[int], barrier: threading.Barrier | None = None, fail: int | None = None) -> tuple[list, dict]:
    """Fake stage loads that upload 100 bytes in two reports and record their thread; with `barrier`, each GPU's
    first stage waits there for the others (so GPUs loaded one after another would time out)."""
    seen: dict[int, Any] = {}

    def make(index: int, gpu: int) -> StageLoad:
        def load(on_upload) -> str:
            seen[index] = threading.current_thread()
            if barrier is not None and index == gpus.index(gpu):
                barrier.wait(timeout=5)
            if index == fail:
                raise RuntimeError(f"stage {index} failed")
            on_upload(60)
            on_upload(40)
            return f"stage {index}"

        return StageLoad(gpu, f"loading stage {index}", 100, load)  # type: ignore[arg-type]  # a name for a stage

    return [make(i, gpu) for i, gpu in enumerate(gpus)], seen


def test_stages_on_one_gpu_load_in_turn_on_this_thread_each_under_its_own_label():
    reports: list[tuple[str, int, int]] = []
    loads, seen = loads_on([0, 0, 0])
    assert load_stages(loads, lambda *report: reports.append(report)) == ["stage 0", "stage 1", "stage 2"]
    assert set(seen.values()) == {threading.current_thread()}
    assert reports == [(f"loading stage {i}", done, 100) for i in range(3) for done in (60, 100, 100)]


def test_several_gpus_upload_at_once_a_thread_each_and_report_one_line():
    reports: list[tuple[str, int, int]] = []
    gpus = [0, 1, 1, 2]
    loads, seen = loads_on(gpus, barrier=threading.Barrier(3))
    stages = load_stages(loads, lambda *report: reports.append(report))
    assert stages == [f"stage {i}" for i in range(4)]  # in stage order, whichever finished first
    assert seen[1] is seen[2] and len({seen[0], seen[1], seen[3]}) == 3  # GPU 1's two stages on one thread
    assert threading.current_thread() not in seen.values()
    assert [total for _, _, total in reports] == [400] * len(reports)
    assert reports[-1] == ("loading weights onto 3 GPUs at once (GPU 0 100%, GPU 1 100%, GPU 2 100%)", 400, 400)
    assert any("GPU 1 30%" in label for label, _, _ in reports)  # 60 of its 200 bytes
    assert [done for _, done, _ in reports] == sorted(done for _, done, _ in reports)


def test_a_stage_that_fails_raises_after_every_gpu_has_stopped():
    loads, seen = loads_on([0, 1], fail=1)
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        load_stages(loads, None)
    assert set(seen) == {0, 1}
