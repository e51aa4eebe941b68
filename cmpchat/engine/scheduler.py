"""Which requests run and what each does in the next engine step; pure bookkeeping, no backend calls.

Policy: first come, first served. At most `slots` requests hold a sequence at once; the rest wait in a bounded
queue (a preempted request waits at its front). Each step spends at most `prefill_chunk` prompt tokens
(oldest request first), so a long prompt is read a chunk at a time between the decode steps of the others
instead of stalling them. Decoding requests form `groups` decode groups of at most `group_rows` each, each
stepped as one batch; a request that starts decoding joins the least loaded group (`spread`: the backend runs
the groups' steps at once) or the first with room (their steps would take turns on one device, so a group
more is a step more).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from cmpchat.engine.active import ActiveRequest
from cmpchat.engine.request import QueueFull


class Scheduler:
    def __init__(
        self,
        *,
        slots: int,
        max_waiting: int,
        prefill_chunk: int,
        groups: int = 1,
        group_rows: int = 16,
        spread: bool = False,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if groups < 1:
            raise ValueError("groups must be >= 1")
        self.slots = slots
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.groups = groups
        self.group_rows = group_rows
        self.spread = spread
        self.waiting: deque[ActiveRequest] = deque()
        self.running: list[ActiveRequest] = []
        """In admission order: the last is the youngest, the first to be preempted."""

    def add(self, item: ActiveRequest) -> None:
        # A request that finds a free slot does not count against the queue bound.
        free = self.slots - len(self.running)
        if len(self.waiting) >= self.max_waiting + max(free, 0):
            raise QueueFull(
                f"the server is busy: {len(self.running)} requests running and {len(self.waiting)} waiting; "
                "try again later"
            )
        self.waiting.append(item)

    def next_to_admit(self) -> ActiveRequest | None:
        """The request that a free slot goes to next, if there is a free slot and a waiting request."""
        if self.waiting and len(self.running) < self.slots:
            return self.waiting[0]
        return None

    def admit(self, item: ActiveRequest) -> None:
        self.waiting.remove(item)
        self.running.append(item)

    def requeue(self, item: ActiveRequest) -> None:
        """Put a preempted request back at the front of the queue."""
        self.running.remove(item)
        self.waiting.appendleft(item)

    def take_cancelled_waiting(self) -> list[ActiveRequest]:
        cancelled = [item for item in self.waiting if item.handle.cancelled]
        for item in cancelled:
            self.waiting.remove(item)
        return cancelled

    def cancelled_running(self) -> list[ActiveRequest]:
        return [item for item in self.running if item.handle.cancelled]

    def prefill_plan(self) -> list[tuple[ActiveRequest, int]]:
        """(request, end) pairs: feed each request's tokens up to `end` this step, within the token budget."""
        budget = self.prefill_chunk
        plan: list[tuple[ActiveRequest, int]] = []
        for item in self.running:
            if budget == 0:
                break
            if not item.is_prefilling:
                continue
            end = min(self.next_boundary(item), item.fed + budget)
            plan.append((item, end))
            budget -= end - item.fed
        return plan

    def next_boundary(self, item: ActiveRequest) -> int:
        """Where the current prefill chunk of `item` ends: the next chunk multiple, save point or end of its
        tokens."""
        start = item.fed
        end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, len(item.tokens))
        return min([end, *(p for p in self.save_points(item) if start < p < end)])

    def save_points(self, item: ActiveRequest) -> list[int]:
        """Prompt positions where the state is kept for later requests: the request's cache points (where the
        next turn of its conversation stops matching, where its opening message ends) and the last chunk
        boundary of a long prompt when no cache point lies past it (a client sending the same long prompt with
        another ending resumes there)."""
        points = list(item.request.cache_points)
        last_boundary = (len(item.prompt) - 1) // self.prefill_chunk * self.prefill_chunk
        if last_boundary > 0 and all(point < last_boundary for point in points):
            points.append(last_boundary)
        return points

    def decoding(self, group: int) -> list[ActiveRequest]:
        return [item for item in self.running if item.is_decoding and item.group == group]

    def group_to_join(self, joining: ActiveRequest) -> int:
        """The decode group `joining`, a request that starts decoding, joins (module docstring)."""
        sizes = [0] * self.groups
        for item in self.running:
            if item.is_decoding and item is not joining:
                sizes[item.group] += 1
        if self.spread:
            return sizes.index(min(sizes))
        return next((group for group, size in enumerate(sizes) if size < self.group_rows), sizes.index(min(sizes)))

    def remove(self, items: Sequence[ActiveRequest]) -> None:
        """Take requests out, running or waiting."""
        for item in items:
            if item in self.running:
                self.running.remove(item)
            elif item in self.waiting:
                self.waiting.remove(item)
