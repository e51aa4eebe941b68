"""GPU time of each launch in a list, measured inside a CUDA graph replay (GPU only).

The launches are captured into a graph with an event-record node between every two kernels, so a replay
runs them back to back as the engine's own graph does, and the events time each kernel where it runs.
An event node costs a microsecond or two of its own, so the per-launch figures add up to more than a plain
replay; `profile_launches` returns both, and `attributed()` spreads the difference evenly back out, so the
per-launch figures add up to the replay (the plain replay's time is the one to report as speed).

    timings = profile_launches(launches, stream, replays=20)
    timings.per_launch   # seconds, one per launch (median over replays)
    timings.replay       # seconds of one replay of the same launches without events

Kernels timed one by one run alone, but in a replay they overlap (early launch, blocks of the next kernel
starting as the last ones of the one before finish), so a kernel's own time can be far more than it adds to
the step. `cost_in_replay` measures that instead: the replay of every launch against the replay without one
group's launches.

    cost_in_replay(launches, stream, kernel_family)   # {"GEMV": seconds, "GDN": seconds, ...}
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from numba import cuda

from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.graph import LaunchGraph
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.raw_launch import RawLaunch

if not SIMULATOR:
    from cuda.bindings import driver


@dataclass(frozen=True)
class LaunchTimings:
    names: tuple[str, ...]
    """Kernel name of each launch."""
    per_launch: tuple[float, ...]
    """Seconds each launch ran (median over replays), measured between event nodes."""
    replay: float
    """Seconds of one replay of the whole list as a plain graph (median over replays)."""

    def attributed(self) -> tuple[float, ...]:
        """Per-launch seconds that add up to the plain replay: the event nodes' own cost, spread evenly
        (their total is the timed sum minus the replay), taken off each launch."""
        excess = (sum(self.per_launch) - self.replay) / max(len(self.per_launch), 1)
        return tuple(max(seconds - excess, 0.0) for seconds in self.per_launch)


def time_launches(
    launches: Launch | Sequence[Launch], repeats: int = 100, warmup: int = 10, *, early_launch: bool = False
) -> float:
    """Seconds per run of `launches` (one or a list run in order): the list is captured as a CUDA graph
    (`early_launch` as `LaunchGraph.capture`'s), and CUDA events time `repeats` replays queued back to back
    after `warmup` replays."""
    sequence = [launches] if isinstance(launches, Launch) else list(launches)
    stream = cuda.stream()
    for launch in sequence:  # compile and load before capture
        launch.run(stream)
    graph = LaunchGraph.capture(sequence, stream, early_launch=early_launch)
    for _ in range(warmup):
        graph.replay(stream)
    start, stop = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(repeats):
        graph.replay(stream)
    stop.record(stream)
    stop.synchronize()
    graph.close()
    return cuda.event_elapsed_time(start, stop) / 1e3 / repeats


def profile_launches(
    launches: Sequence[Launch | RawLaunch], stream: Any, replays: int = 20, *, early_launch: bool = False
) -> LaunchTimings:
    """Time every launch of `launches` (already compiled: run them once first) and the whole list; `early_launch`
    binds the `Launch`es as `LaunchGraph.capture` does."""
    if SIMULATOR:
        raise RuntimeError("profiling needs a GPU; the CUDA simulator has no timers")
    raw = [item if isinstance(item, RawLaunch) else RawLaunch(item, early_launch=early_launch) for item in launches]
    handle = stream_handle(stream)
    events = [check("cuEventCreate", driver.cuEventCreate(0)) for _ in range(len(raw) + 1)]
    try:
        timed = _capture_with_events(raw, events, handle)
        samples: list[list[float]] = [[] for _ in raw]
        for _ in range(replays):
            check("cuGraphLaunch", driver.cuGraphLaunch(timed, handle))
            check("cuStreamSynchronize", driver.cuStreamSynchronize(handle))
            for i in range(len(raw)):
                elapsed = check("cuEventElapsedTime", driver.cuEventElapsedTime(events[i], events[i + 1]))
                samples[i].append(elapsed / 1e3)
        check("cuGraphExecDestroy", driver.cuGraphExecDestroy(timed))
        replay = _plain_replay_seconds(raw, stream, replays)
    finally:
        for event in events:
            driver.cuEventDestroy(event)
    return LaunchTimings(
        names=tuple(launch.kernel_name for launch in raw),
        per_launch=tuple(statistics.median(s) for s in samples),
        replay=replay,
    )


def cost_in_replay(
    launches: Sequence[Launch | RawLaunch],
    stream: Any,
    group_of: Callable[[str], str],
    replays: int = 20,
    *,
    early_launch: bool = False,
) -> dict[str, float]:
    """Per group of launches (`group_of(kernel name)`), the seconds a plain replay of all of them takes more
    than a replay with that group's launches left out: what the group costs where it runs among the others.

    What stays reads buffers the left-out launches no longer write: fine for decode kernels, whose time depends
    on sizes and on positions the host writes, not on the values they read. `early_launch` as `profile_launches`'.
    """
    if SIMULATOR:
        raise RuntimeError("profiling needs a GPU; the CUDA simulator has no timers")
    raw = [item if isinstance(item, RawLaunch) else RawLaunch(item, early_launch=early_launch) for item in launches]
    groups = [group_of(launch.kernel_name) for launch in raw]

    full = _plain_replay_seconds(raw, stream, replays)
    costs = {}
    for group in dict.fromkeys(groups):
        kept = [launch for launch, g in zip(raw, groups, strict=True) if g != group]
        costs[group] = full - _plain_replay_seconds(kept, stream, replays)
    return costs


def _capture_with_events(raw: list[RawLaunch], events: list[Any], handle: int) -> Any:
    """An executable graph: event 0, launch 0, event 1, launch 1, ..., event n."""
    external = driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    with cuda.defer_cleanup():
        check("cuStreamBeginCapture", driver.cuStreamBeginCapture(handle, mode))
        try:
            for event, launch in zip(events, raw, strict=False):
                check("cuEventRecordWithFlags", driver.cuEventRecordWithFlags(event, handle, external))
                launch(handle)
            check("cuEventRecordWithFlags", driver.cuEventRecordWithFlags(events[-1], handle, external))
        finally:
            graph = check("cuStreamEndCapture", driver.cuStreamEndCapture(handle))
    try:
        graph_exec = check("cuGraphInstantiate", driver.cuGraphInstantiate(graph, 0))
    finally:
        check("cuGraphDestroy", driver.cuGraphDestroy(graph))
    check("cuGraphUpload", driver.cuGraphUpload(graph_exec, handle))
    return graph_exec


def _plain_replay_seconds(raw: list[RawLaunch], stream: Any, replays: int) -> float:
    """Median seconds of one replay of `raw` captured as a plain graph (0 for no launches)."""
    if not raw:
        return 0.0
    graph = LaunchGraph.capture(raw, stream)
    try:
        return _time_replays(graph, stream, replays)
    finally:
        graph.close()


def _time_replays(graph: LaunchGraph, stream: Any, replays: int) -> float:
    """Median seconds of one replay, each timed by events around it (replays back to back, warm)."""
    graph.replay(stream)
    times = []
    start, stop = cuda.event(), cuda.event()
    for _ in range(replays):
        start.record(stream)
        graph.replay(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)
