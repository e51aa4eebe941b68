"""Which requests run and what each does in the next engine step; pure bookkeeping, no backend calls.

Policy: first come, first served. At most `slots` requests hold a sequence at once; the rest wait in a
bounded queue. Each step spends at most `prefill_chunk` prompt tokens on prefill (oldest request first),
so a long prompt is processed a chunk at a time between the decode steps of the others instead of
stalling them; every request with a sampled token then decodes in one batched step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from cmpchat.engine.active import ActiveRequest
from cmpchat.engine.request import QueueFull


class Scheduler:
    def __init__(self, *, slots: int, max_waiting: int, prefill_chunk: int) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.slots = slots
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[ActiveRequest] = deque()
        self.running: list[ActiveRequest] = []

    def add(self, item: ActiveRequest) -> None:
        # A request that finds a free slot does not count against the queue bound.
        free = self.slots - len(self.running)
        if len(self.waiting) >= self.max_waiting + max(free, 0):
            raise QueueFull(
                f"the server is busy: {len(self.running)} requests running and {len(self.waiting)} waiting; "
                "try again later"
            )
        self.waiting.append(item)

    def admit(self) -> list[ActiveRequest]:
        """Move waiting requests into free slots, oldest first; return the newly admitted ones."""
        admitted: list[ActiveRequest] = []
        while self.waiting and len(self.running) < self.slots:
            item = self.waiting.popleft()
            self.running.append(item)
            admitted.append(item)
        return admitted

    def take_cancelled_waiting(self) -> list[ActiveRequest]:
        cancelled = [item for item in self.waiting if item.handle.cancelled]
        for item in cancelled:
            self.waiting.remove(item)
        return cancelled

    def cancelled_running(self) -> list[ActiveRequest]:
        return [item for item in self.running if item.handle.cancelled]

    def prefill_plan(self) -> list[tuple[ActiveRequest, int]]:
        """(request, end) pairs: feed each request's prompt up to `end` this step, within the token budget."""
        budget = self.prefill_chunk
        plan: list[tuple[ActiveRequest, int]] = []
        for item in self.running:
            if budget == 0:
                break
            if not item.is_prefilling or item.sequence is None:
                continue
            end = min(self.next_boundary(item), item.prefilled + budget)
            plan.append((item, end))
            budget -= end - item.prefilled
        return plan

    def next_boundary(self, item: ActiveRequest) -> int:
        """Where the current prefill chunk of `item` ends: the next chunk multiple, cache point or prompt end."""
        start = item.prefilled
        end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, len(item.prompt))
        return min([end, *(p for p in item.request.cache_points if start < p < end)])

    def is_save_point(self, item: ActiveRequest, position: int) -> bool:
        """Whether the state after `position` prompt tokens is kept for reuse (never the whole prompt)."""
        if position >= len(item.prompt):
            return False
        return position % self.prefill_chunk == 0 or position in item.request.cache_points

    def decode_batch(self) -> list[ActiveRequest]:
        return [item for item in self.running if item.next_token is not None]

    def remove(self, items: Sequence[ActiveRequest]) -> None:
        for item in items:
            if item in self.running:
                self.running.remove(item)
