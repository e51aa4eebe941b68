"""Decode steps of several groups in flight through a pipeline's stages, driven by one host thread.

A decode step goes through the stages in turn, and between two stages its hidden states cross through host
memory: the host must see them arrive there before it queues their copy onward (`bridge.py`). Waiting for every
hop as soon as a step is queued would leave the other stages idle meanwhile. So a step is queued on the first
stage and left in flight: the host hands it on one stage further whenever its bytes are already in host memory
when it looks (`poll`, at every step and selection), and waits for them only when something needs what the step
makes: its selection's ids (`DeferredChoice`), its group's next step (the group's buffers), or any other backend
call (`drain`: it may touch the states, pages or buffers the step has yet to use). With N stages and N groups,
stage k runs group g's step while stage k + 1 runs the step of the group queued before it.

Steps cross each hop in the order they entered the pipeline, as a hop's host buffers are handed on in turn: a
step passes a hop only after every older step has. Each group has its own step buffers on every stage and its
own sampler, which writes the chosen ids into the group's token input on the first stage when both ends are on
one GPU (across GPUs the ids come back through the host).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cmpchat.backends.base import Selection, Selector
from cmpchat.backends.gpu.bridge import HostBridge
from cmpchat.backends.gpu.buffers import ordering_event
from cmpchat.backends.gpu.sampler import GpuChoice, GpuSampler
from cmpchat.backends.gpu.stage import Stage
from cmpchat.backends.gpu.step import MAX_ROWS
from cmpchat.sampling import TokenLogprobs


@dataclass(eq=False)
class InFlightStep:
    """A decode step of `group`'s `rows` rows, queued on the stages before `stage`."""

    group: int
    rows: int
    bucket: int
    prompt: bool
    stage: int = 0
    """The next stage to queue it on (the stage count once every stage has it)."""
    selection: DeferredChoice | None = None
    """The choice of its next tokens, queued when the last stage has the step."""


class DeferredChoice(Selection):
    """Ids that will be chosen from a step still in flight: the choice is queued once the step reaches the last
    stage (the host hands it on), at the latest when its ids are asked for."""

    def __init__(self, pipeline: DecodePipeline, step: InFlightStep, choose: Callable[[], GpuChoice]) -> None:
        self._pipeline, self._step, self._choose = pipeline, step, choose
        self._choice: GpuChoice | None = None
        self._error: Exception | None = None
        self.rows = step.rows

    def queue(self) -> None:
        """Queue the choice (the step has reached the last stage). It may be queued while the host serves another
        group's call: a failure is kept for this choice's reader, not raised there."""
        try:
            self._choice = self._choose()
        except Exception as error:
            self._error = error

    def tokens(self) -> list[int]:
        return self._queued().tokens()

    def logprobs(self) -> list[TokenLogprobs | None]:
        return self._queued().logprobs()

    def _queued(self) -> GpuChoice:
        if self._choice is None and self._error is None:
            self._pipeline.force(self._step)
        if self._error is not None:
            raise self._error
        assert self._choice is not None, "a step's choice is queued when the step reaches the last stage"
        return self._choice


class DecodePipeline:
    """The decode steps of `groups` groups through `stages`, their hand-offs and their token selections."""

    def __init__(self, stages: Sequence[Stage], groups: int, hidden_size: int, use_graphs: bool) -> None:
        self.stages = list(stages)
        first, last = self.stages[0], self.stages[-1]
        self.bridges = [
            HostBridge((stage.on_device, stage.stream), (after.on_device, after.stream), MAX_ROWS * hidden_size,
                       buffers=groups + 1)
            for stage, after in zip(self.stages, self.stages[1:], strict=False)
        ]  # fmt: skip
        """A hop's host buffers: one for a step of every group, and one more so a hop never waits for one."""
        self.ids_on_device = first.gpu.index == last.gpu.index
        """Whether the selection writes the chosen ids into the first stage's token input (same GPU; across
        GPUs they come back through the host, as there is no P2P)."""
        with last.on_device():
            self.samplers = [
                GpuSampler(
                    last.stream,
                    use_graphs,
                    last.group_buffers[group].logits,
                    (first if self.ids_on_device else last).group_buffers[group].tokens,
                )
                for group in range(groups)
            ]
            self._selected = ordering_event()
        self.fed: list[Selection | None] = [None] * groups
        """Per group, the selection whose ids its first-stage token input holds (no upload since)."""
        self._in_flight: deque[InFlightStep] = deque()

    # -- steps ------------------------------------------------------------------------------------

    def start(self, group: int, rows: int, bucket: int, prompt: bool) -> InFlightStep:
        """Queue a step of `group` on the first stage (its inputs uploaded on every stage) and leave it in flight;
        the caller has forced the group's previous step (`force_group`)."""
        step = InFlightStep(group, rows, bucket, prompt)
        self._queue_on_next_stage(step)
        if step.stage < len(self.stages):
            self._in_flight.append(step)
        self.poll()
        return step

    def poll(self) -> None:
        """Hand every step in flight on as far as its bytes have already reached host memory (no waiting)."""
        frontier = len(self.stages)  # the least stage an older step waits to be queued on
        for step in self._in_flight:
            while step.stage < frontier and self.bridges[step.stage - 1].ready():
                self._hand_on(step)
            frontier = min(frontier, step.stage)
        self._retire()

    def force(self, step: InFlightStep) -> None:
        """Queue `step` (and every older step) on every stage, waiting for their hops' bytes."""
        if step.stage == len(self.stages):
            return
        for older in self._in_flight:
            while older.stage < len(self.stages):
                self._hand_on(older)
            if older is step:
                break
        self._retire()

    def force_group(self, group: int) -> None:
        """Queue the group's step in flight, if any, on every stage (its buffers are about to be used again)."""
        for step in self._in_flight:
            if step.group == group:
                self.force(step)
                return

    def drain(self) -> None:
        """Queue every step in flight on every stage."""
        if self._in_flight:
            self.force(self._in_flight[-1])

    def _hand_on(self, step: InFlightStep) -> None:
        """Deliver `step`'s hidden states to its next stage (waiting for them in host memory) and queue it there."""
        stage = self.stages[step.stage]
        with stage.on_device():
            self.bridges[step.stage - 1].deliver(stage.group_buffers[step.group].hidden[: step.rows])
        self._queue_on_next_stage(step)

    def _queue_on_next_stage(self, step: InFlightStep) -> None:
        stage = self.stages[step.stage]
        with stage.on_device():
            stage.run_decode(step.bucket, step.prompt, step.group)
        step.stage += 1
        if step.stage < len(self.stages):
            self.bridges[step.stage - 1].take(stage.group_buffers[step.group].hidden[: step.rows])
        elif step.selection is not None:
            step.selection.queue()

    def _retire(self) -> None:
        while self._in_flight and self._in_flight[0].stage == len(self.stages):
            self._in_flight.popleft()

    # -- selection --------------------------------------------------------------------------------

    def select(self, group: int, logits: Any, step: InFlightStep | None, selectors: Sequence[Selector]) -> Selection:
        """Choose a token for each row of `logits` (on the last stage, of `group`'s buffers or not) with the
        group's sampler: queued now if `step` (the step that makes them) has reached the last stage, else once it
        does. The selectors' histories are read now; their generators when the choice is queued (the engine draws
        from a reply's generator only for its next choice, after reading this one)."""
        sampler = self.samplers[group]
        params = [s.params for s in selectors]
        histories = [list(s.history[-sampler.history_window(params) :]) for s in selectors]
        rngs = [s.rng for s in selectors]
        allowed = [s.allowed for s in selectors]
        logprobs = [s.logprobs for s in selectors]

        def choose() -> GpuChoice:
            first, last = self.stages[0], self.stages[-1]
            with last.on_device():
                choice = sampler.select(logits, params, histories, rngs, allowed=allowed, logprobs=logprobs)
                if len(self.stages) > 1 and self.ids_on_device:  # the first stage's next step reads the ids
                    self._selected.record(last.stream)
                    self._selected.wait(first.stream)
            return choice

        chosen: Selection
        if step is not None and step.stage < len(self.stages):
            chosen = step.selection = DeferredChoice(self, step, choose)
            self.poll()
        else:
            chosen = choose()
        self.fed[group] = chosen
        return chosen
