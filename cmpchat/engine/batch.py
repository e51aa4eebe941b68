"""The batching engine: many replies over one backend, driven step by step or from its own thread.

Each step: drop cancelled requests, admit waiting ones into free slots (resuming from the longest saved
prompt prefix), prefill up to one chunk of prompt tokens (sampling the first token of each prompt that is
done), run one batched decode step for every request with a sampled token and sample its rows in one
`backend.sample` call, feed each token to its request's `Reply` (the same stop rules and output parsing as
the single-sequence generator), and hand each request its new events. Logits stay as the backend returned
them (on a GPU backend, a view of its step buffer on the GPU) and are sampled before the next step. The
engine knows nothing of HTTP or asyncio: events go to a callback per request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

from cmpchat.backends.base import Backend
from cmpchat.engine.active import ActiveRequest
from cmpchat.engine.events import DecodeProgress, PromptProgress
from cmpchat.engine.prefix_cache import PrefixCache
from cmpchat.engine.reply import Reply
from cmpchat.engine.request import (
    EngineEvent,
    EngineStopped,
    EventSink,
    Failed,
    GenerationRequest,
    RequestHandle,
    Started,
)
from cmpchat.engine.scheduler import Scheduler
from cmpchat.engine.stats import EngineStats
from cmpchat.tokenizer import Tokenizer

log = logging.getLogger("cmpchat.api")


class BatchEngine:
    """Serves requests over `backend` with up to `slots` sequences decoding together.

    `prefill_chunk` is the engine's, not the request's (`GenerationOptions.prefill_chunk` is not used
    here): chunk boundaries are positions in the prompt shared by every request, so that states saved at
    them by one request can be resumed by another. `cache_entries` bounds the saved states (0: no reuse).
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        *,
        slots: int = 4,
        max_waiting: int = 64,
        prefill_chunk: int = 512,
        cache_entries: int = 16,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(slots=slots, max_waiting=max_waiting, prefill_chunk=prefill_chunk)
        self.prefix_cache = PrefixCache(backend, cache_entries)
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._dirty: list[ActiveRequest] = []

    # -- the submitter's side (any thread) --------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: EventSink) -> RequestHandle:
        """Queue `request`; its events go to `sink`. Raises `CmpchatError` for a prompt that cannot be
        served (empty, longer than the context) and `QueueFull` when the waiting queue is full."""
        reply = Reply(
            self.tokenizer,
            request.prompt,
            request.options,
            self.backend.config.context_length,
            starts_in_reasoning=request.starts_in_reasoning,
            tools=request.tools,
        )
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            handle = RequestHandle(next(self._ids), self._wake)
            self.scheduler.add(ActiveRequest(handle, request, reply, sink, time.perf_counter()))
            self._wakeup.notify()
        return handle

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify()

    # -- the loop ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Run steps on a daemon thread until `stop`."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._thread = threading.Thread(target=self._run, name="cmpchat-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop taking requests, cancel those left, and free every sequence and saved state."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        leftover = [*self.scheduler.waiting, *self.scheduler.running]
        self.scheduler.waiting.clear()
        self._finish(leftover, cancelled=True)
        self._publish()
        self.prefix_cache.clear()

    def run_until_idle(self) -> None:
        """Step until no request is left (for callers that drive the engine themselves)."""
        while self.step():
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not (self.scheduler.waiting or self.scheduler.running):
                    self._wakeup.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug in a step must not take the server down with it
                log.exception("engine step failed")
                self._fail(list(self.scheduler.running), "internal error in the engine step")
                self._publish()

    def step(self) -> bool:
        """One scheduling step; True while requests are left running or waiting."""
        with self._lock:
            cancelled = self.scheduler.take_cancelled_waiting()
            admitted = self.scheduler.admit()
        self._finish(cancelled + self.scheduler.cancelled_running(), cancelled=True)
        for item in admitted:
            self._start(item)
        self._prefill()
        self._decode()
        self._publish()
        with self._lock:
            return bool(self.scheduler.waiting or self.scheduler.running)

    # -- the phases -------------------------------------------------------------------------------

    def _start(self, item: ActiveRequest) -> None:
        item.admitted_at = time.perf_counter()
        try:
            hit = self.prefix_cache.lookup(item.prompt)
            item.sequence = hit.sequence if hit is not None else self.backend.new_sequence()
        except Exception as err:
            self._fail([item], _describe(err))
            return
        item.prefilled = item.cached_tokens = hit.length if hit is not None else 0
        self.stats.cached_prompt_tokens += item.cached_tokens
        self._emit(item, [Started(item.cached_tokens, item.admitted_at - item.submitted_at)])

    def _prefill(self) -> None:
        for item, end in self.scheduler.prefill_plan():
            started = time.perf_counter()
            try:
                logits = self.backend.prefill(item.sequence, item.prompt[item.prefilled : end])
                if self.scheduler.is_save_point(item, end):
                    self.prefix_cache.save(item.prompt[:end], item.sequence)
            except Exception as err:
                self._fail([item], _describe(err))
                continue
            now = time.perf_counter()
            self.stats.prompt_tokens += end - item.prefilled
            self.stats.prompt_seconds += now - started
            item.prefilled = end
            processed = end - item.cached_tokens
            rate = processed / (now - item.admitted_at) if now > item.admitted_at else 0.0
            self._emit(item, [PromptProgress(end, len(item.prompt), rate)])
            if not item.is_prefilling:
                item.prompt_done_at = now
                # Sampled now: a GPU backend's logits are a view of its step buffer, which the decode step
                # below overwrites. The request then joins that step.
                self._sample([item], logits)

    def _decode(self) -> None:
        batch = self.scheduler.decode_batch()
        if not batch:
            return
        started = time.perf_counter()
        try:
            logits = self.backend.decode([item.sequence for item in batch], [item.next_token for item in batch])
        except Exception as err:
            self._fail(batch, _describe(err))
            return
        for item in batch:
            item.next_token = None
            item.decode_steps += 1
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(batch)
        self._sample(batch, logits, decode_started=started)

    def _sample(self, items: list[ActiveRequest], logits: object, decode_started: float | None = None) -> None:
        """Select the next token of each of `items` from the rows of `logits` (as the backend returned
        them) in one call, and feed each to its reply. For a decode step's logits, `decode_started` is when
        the step was called: its time runs until the tokens are back (a GPU backend's decode() only queues)."""
        try:
            tokens = self.backend.sample(
                logits,
                [item.reply.sampling for item in items],
                [item.reply.history for item in items],
                [item.reply.rng for item in items],
            )
        except Exception as err:
            self._fail(items, _describe(err))
            return
        now = time.perf_counter()
        if decode_started is not None:
            self.stats.decode_seconds += now - decode_started
        done: list[ActiveRequest] = []
        for item, token in zip(items, tokens, strict=True):
            if item.first_token_at is None:
                item.first_token_at = now
            item.last_token_at = now
            try:
                events = item.reply.accept(int(token))
            except Exception as err:
                self._fail([item], _describe(err))
                continue
            self.stats.generated_tokens += 1
            self._emit(item, events)
            if item.reply.done:
                done.append(item)
            else:
                item.next_token = int(token)
                elapsed = now - item.first_token_at
                self._emit(
                    item, [DecodeProgress(item.reply.generated, item.decode_steps / elapsed if elapsed else 0.0)]
                )
        self._finish(done, cancelled=False)

    # -- endings and events -----------------------------------------------------------------------

    def _finish(self, items: Sequence[ActiveRequest], *, cancelled: bool) -> None:
        for item in items:
            if cancelled:
                item.reply.cancel()
            self._emit(item, item.reply.finish(item.timings()))
            self.stats.count_finish(item.reply.finish_reason or "length", item.reply.tool_calls != [])
            self._release(item)

    def _fail(self, items: Sequence[ActiveRequest], message: str) -> None:
        for item in items:
            log.error("request %d failed: %s", item.handle.id, message)
            item.reply.cancel()
            self.stats.failed += 1
            self._emit(item, [Failed(message)])
            self._release(item)

    def _release(self, item: ActiveRequest) -> None:
        self.scheduler.remove([item])
        if item.sequence is not None:
            sequence, item.sequence = item.sequence, None
            try:
                self.backend.release(sequence)
            except Exception:
                log.exception("releasing the sequence of request %d failed", item.handle.id)

    def _emit(self, item: ActiveRequest, events: Sequence[EngineEvent]) -> None:
        if not events:
            return
        if not item.outbox:
            self._dirty.append(item)
        item.outbox.extend(events)

    def _publish(self) -> None:
        dirty, self._dirty = self._dirty, []
        for item in dirty:
            events, item.outbox = item.outbox, []
            try:
                item.sink(events)
            except Exception:
                # The submitter's callback is broken; stop generating for it rather than for everyone.
                log.exception("delivering events of request %d failed", item.handle.id)
                item.handle.cancel()


def _describe(err: Exception) -> str:
    return f"the backend failed: {type(err).__name__}: {err}"
