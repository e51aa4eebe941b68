"""The generation loop over any backend: chunked prefill, sampling, stop rules, parsed, timed events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend
from cmpchat.chat.messages import Tool
from cmpchat.chat.output_parser import ContentDelta, OutputParser, ReasoningDelta, ToolCallEvent
from cmpchat.errors import CmpchatError
from cmpchat.generation.events import DecodeProgress, Finished, FinishReason, GenerationEvent, PromptProgress, Timings
from cmpchat.generation.sampling import SamplingParams
from cmpchat.generation.stop import StopStringMatcher
from cmpchat.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Limits and sampling for one reply."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    """Most tokens to generate; None runs until an end token or the context is full."""
    stop: tuple[str, ...] = ()
    """Strings that end the reply where they appear; they are not included in it."""
    prefill_chunk: int = 512
    """Prompt tokens per prefill call; progress is reported after each."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")


class Generator:
    """Generates replies from a backend, one sequence per call to `generate`."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self._end_tokens = frozenset(tokenizer.eos_token_ids)

    def generate(
        self,
        prompt: Sequence[int],
        options: GenerationOptions | None = None,
        *,
        starts_in_reasoning: bool = False,
        tools: Sequence[Tool] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream the reply to `prompt` (token ids); the last event is always `Finished`.

        `starts_in_reasoning` says the prompt opened a `<think>` block. Setting `cancel` stops the
        reply after the current step with reason "cancelled"; what was generated so far is kept.
        """
        options = options or GenerationOptions()
        context = self.backend.config.context_length
        if not prompt:
            raise CmpchatError("the prompt is empty")
        if len(prompt) >= context:
            raise CmpchatError(
                f"the prompt is {len(prompt)} tokens but the model's context holds {context}; shorten it"
            )
        budget = context - len(prompt)
        if options.max_tokens is not None:
            budget = min(budget, options.max_tokens)

        backend = self.backend
        sampling = options.sampling
        rng = np.random.default_rng(sampling.seed)
        sequence = backend.new_sequence()
        history = list(prompt)
        decoder = self.tokenizer.stream_decoder()
        stopper = StopStringMatcher(options.stop)
        parser = OutputParser(starts_in_reasoning, tools=tools)
        collected = _Collected()
        cancelled = lambda: cancel is not None and cancel.is_set()  # noqa: E731

        try:
            start = time.perf_counter()
            logits = None
            for begin in range(0, len(prompt), options.prefill_chunk):
                chunk = prompt[begin : begin + options.prefill_chunk]
                logits = backend.prefill(sequence, chunk)
                done = begin + len(chunk)
                yield PromptProgress(done, len(prompt), done / (time.perf_counter() - start))
                if cancelled():
                    break
            prompt_seconds = time.perf_counter() - start
            first_token_at = None
            decode_seconds = 0.0
            decode_steps = 0
            generated = 0
            reason: FinishReason = "cancelled" if cancelled() else "length"
            while reason != "cancelled" and generated < budget:
                token = backend.sample(logits, [sampling], [history], [rng])[0]
                if first_token_at is None:
                    first_token_at = time.perf_counter() - start
                generated += 1
                if token in self._end_tokens:
                    reason = "stop"
                    break
                history.append(token)
                yield from collected.take(parser.feed(stopper.feed(decoder.feed(token))))
                if stopper.stopped:
                    reason = "stop"
                    break
                if generated >= budget:
                    break
                if cancelled():
                    reason = "cancelled"
                    break
                step_start = time.perf_counter()
                logits = backend.decode([sequence], [token])[0]
                decode_seconds += time.perf_counter() - step_start
                decode_steps += 1
                yield DecodeProgress(generated, decode_steps / decode_seconds if decode_seconds > 0 else 0.0)

            tail = decoder.flush()
            yield from collected.take(parser.feed(stopper.feed(tail)) + parser.feed(stopper.flush()) + parser.finish())
            if reason == "stop" and collected.tool_calls:
                reason = "tool_calls"
            timings = Timings(
                prompt_tokens=len(prompt),
                prompt_seconds=prompt_seconds,
                generated_tokens=generated,
                decode_steps=decode_steps,
                decode_seconds=decode_seconds,
                time_to_first_token=first_token_at if first_token_at is not None else prompt_seconds,
            )
            yield Finished(
                reason, "".join(collected.content), "".join(collected.reasoning), tuple(collected.tool_calls), timings
            )
        finally:
            backend.release(sequence)


class _Collected:
    """The full texts and calls of a reply, gathered while its events stream past."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCallEvent] = []

    def take(self, events: list[Any]) -> Iterator[Any]:
        for event in events:
            if isinstance(event, ContentDelta):
                self.content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
            elif isinstance(event, ToolCallEvent):
                self.tool_calls.append(event)
            yield event
