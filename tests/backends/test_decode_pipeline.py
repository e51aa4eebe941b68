"""Decode steps of several groups in flight through a pipeline (`decode_pipeline.py`), with stand-in stages under
Numba's simulator: the order the host queues each stage's steps in, when it waits, and that each group's hidden
states reach the next stage byte for byte. Whether a hop's bytes are in host memory is the test's to say (the
simulator runs every copy at once, so by itself every hop would always be ready)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.base import HostSelection, Selector
from cmpchat.backends.gpu.bridge import HostBridge
from cmpchat.backends.gpu.decode_pipeline import DecodePipeline
from cmpchat.sampling import SamplingParams

WIDTH = 8


class FakeStage:
    """A stage whose step maps each row's hidden state h to 2h + its index + 1 (and logs what it ran)."""

    def __init__(self, index: int, groups: int, log: list[tuple[int, int]]) -> None:
        self.index, self.log = index, log
        self.gpu = SimpleNamespace(index=0)
        self.stream = cuda.stream()
        self.group_buffers = [
            SimpleNamespace(
                hidden=cuda.to_device(np.zeros((16, WIDTH), np.float32)),
                logits=cuda.to_device(np.zeros((16, 4), np.float32)),
                tokens=cuda.to_device(np.zeros(16, np.int32)),
            )
            for _ in range(groups)
        ]

    def on_device(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def run_decode(self, bucket: int, prompt: bool, group: int) -> None:
        self.log.append((self.index, group))
        hidden = self.group_buffers[group].hidden
        hidden.copy_to_device(2 * hidden.copy_to_host() + self.index + 1)


class FakeSampler:
    history_window = staticmethod(lambda params: 4)

    def __init__(self, log: list[tuple[int, int]], group: int) -> None:
        self.log, self.group = log, group

    def select(self, logits, params, histories, rngs, allowed=None, logprobs=None):
        self.log.append((-1, self.group))  # -1: a selection, queued on the last stage
        return HostSelection([self.group] * len(params))


def pipeline(stages: int, groups: int) -> tuple[DecodePipeline, list[tuple[int, int]]]:
    log: list[tuple[int, int]] = []
    fakes: list = [FakeStage(i, groups, log) for i in range(stages)]
    pipe = DecodePipeline(fakes, groups, WIDTH, use_graphs=False)
    pipe.samplers = [FakeSampler(log, g) for g in range(groups)]  # type: ignore[misc]
    return pipe, log


def start(pipe: DecodePipeline, group: int, rows: int, value: float):
    """A step of `rows` rows whose first-stage hidden states are `value` before the stage's step."""
    pipe.force_group(group)
    hidden = pipe.stages[0].group_buffers[group].hidden
    hidden.copy_to_device(np.full((16, WIDTH), value, np.float32))
    return pipe.start(group, rows, rows, prompt=False)


def through(value: float, stages: int) -> float:
    for index in range(stages):
        value = 2 * value + index + 1
    return value


def choose(pipe: DecodePipeline, group: int, step):
    logits = pipe.stages[-1].group_buffers[group].logits[: step.rows]
    return pipe.select(
        group, logits, step, [Selector(SamplingParams(), [1, 2, 3], np.random.default_rng(0))] * step.rows
    )


@pytest.fixture
def hops_never_ready(monkeypatch):
    """Hops are never found ready: the host hands a step on only where it has to wait for it."""
    monkeypatch.setattr(HostBridge, "ready", lambda self: False)


def test_steps_wait_in_flight_until_their_ids_are_asked_for(hops_never_ready):
    pipe, log = pipeline(stages=3, groups=3)
    steps = [start(pipe, group, rows=2, value=group + 1) for group in range(3)]
    assert log == [(0, 0), (0, 1), (0, 2)]  # each on the first stage only: nothing waited for a hop
    choices = [choose(pipe, group, step) for group, step in enumerate(steps)]
    assert len(log) == 3  # the choices wait for their steps too
    assert choices[1].tokens() == [1, 1]
    # Group 1's ids need its step on every stage, and group 0's goes first (hops hand on in order); group 2
    # stays on the first stage.
    assert log[3:] == [(1, 0), (2, 0), (-1, 0), (1, 1), (2, 1), (-1, 1)]
    pipe.drain()
    assert log[9:] == [(1, 2), (2, 2), (-1, 2)]
    for group in range(3):
        hidden = pipe.stages[-1].group_buffers[group].hidden.copy_to_host()
        assert np.array_equal(hidden[:2], np.full((2, WIDTH), through(group + 1, 3), np.float32))
    assert [bridge.handoffs for bridge in pipe.bridges] == [3, 3]


def test_a_groups_next_step_first_queues_its_last_on_every_stage(hops_never_ready):
    pipe, log = pipeline(stages=2, groups=2)
    first = start(pipe, 0, rows=1, value=1.0)
    choose(pipe, 0, first)
    start(pipe, 1, rows=1, value=5.0)
    assert log == [(0, 0), (0, 1)]
    start(pipe, 0, rows=1, value=3.0)  # group 0's buffers are needed again: its step goes through first
    assert log[2:] == [(1, 0), (-1, 0), (0, 0)]
    assert pipe.fed[0] is not None


def test_a_step_goes_on_by_itself_where_its_bytes_have_arrived():
    pipe, log = pipeline(stages=3, groups=2)
    step = start(pipe, 0, rows=4, value=2.0)  # the simulator's copies are done at once: nothing waits
    assert log == [(0, 0), (1, 0), (2, 0)]
    choice = choose(pipe, 0, step)
    assert log[3:] == [(-1, 0)] and choice.tokens() == [0] * 4
    hidden = pipe.stages[-1].group_buffers[0].hidden.copy_to_host()
    assert np.array_equal(hidden[:4], np.full((4, WIDTH), through(2.0, 3), np.float32))


def test_a_newer_step_does_not_pass_an_older_one_at_a_hop(monkeypatch):
    pipe, log = pipeline(stages=3, groups=2)
    ready = {"hop 0": False}
    monkeypatch.setattr(HostBridge, "ready", lambda self: self is pipe.bridges[0] and ready["hop 0"])
    start(pipe, 0, rows=1, value=1.0)
    start(pipe, 1, rows=1, value=2.0)
    ready["hop 0"] = True
    pipe.poll()
    # Both cross hop 0 (in order); neither crosses hop 1, which is never found ready.
    assert log == [(0, 0), (0, 1), (1, 0), (1, 1)]
    pipe.drain()
    assert log[4:] == [(2, 0), (2, 1)]


def test_one_stage_selects_at_once():
    pipe, log = pipeline(stages=1, groups=1)
    step = start(pipe, 0, rows=1, value=1.0)
    assert step.stage == 1 and pipe.bridges == []
    assert isinstance(choose(pipe, 0, step), HostSelection) and log == [(0, 0), (-1, 0)]


def test_a_choice_that_fails_while_another_group_is_served_fails_for_its_own_reader(hops_never_ready):
    pipe, log = pipeline(stages=2, groups=2)
    step = start(pipe, 0, rows=1, value=1.0)
    choice = choose(pipe, 0, step)

    def broken(*args, **kwargs):
        raise RuntimeError("the sampler failed")

    pipe.samplers[0].select = broken  # type: ignore[method-assign]
    start(pipe, 1, rows=1, value=2.0)
    pipe.drain()  # group 0's choice is queued here, while serving another call: its failure waits for its reader
    with pytest.raises(RuntimeError, match="the sampler failed"):
        choice.tokens()
