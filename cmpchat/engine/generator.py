"""The generation loop for one sequence over any backend: chunked prefill, then sample, accept, decode."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from cmpchat.backends.base import Backend
from cmpchat.chat.messages import Tool
from cmpchat.engine.events import DecodeProgress, GenerationEvent, PromptProgress, Timings
from cmpchat.engine.reply import GenerationOptions, Reply
from cmpchat.errors import CmpchatError
from cmpchat.tokenizer import Tokenizer

__all__ = ["GenerationOptions", "Generator"]


class Generator:
    """Generates replies from a backend, one sequence per call to `generate`."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer) -> None:
        self.backend = backend
        self.tokenizer = tokenizer

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
        backend = self.backend
        reply = Reply(
            self.tokenizer,
            prompt,
            options,
            backend.config.context_length,
            starts_in_reasoning=starts_in_reasoning,
            tools=tools,
        )
        sequence = backend.new_sequence()
        try:
            start = time.perf_counter()
            logits = None
            for begin in range(0, len(prompt), options.prefill_chunk):
                chunk = prompt[begin : begin + options.prefill_chunk]
                logits = backend.prefill(sequence, chunk)
                done = begin + len(chunk)
                yield PromptProgress(done, len(prompt), done / (time.perf_counter() - start))
                if cancel is not None and cancel.is_set():
                    reply.cancel()
                    break
            prompt_seconds = time.perf_counter() - start
            first_token_at = None
            decode_started = 0.0
            decode_seconds = 0.0
            decode_steps = 0
            while not reply.done:
                choice = backend.choose(logits, [reply.sampling], [reply.history], [reply.rng])
                # Where decode() only queues, the step that consumes this token is queued before its id is read
                # back, so the GPU runs it while the host turns the token into text (and while the caller
                # handles the events). It is wasted when the token ends the reply; the sequence is released then.
                cancelled = cancel is not None and cancel.is_set()
                queued = backend.decode_is_queued and not cancelled and not reply.next_is_last
                refused: CmpchatError | None = None
                if queued:
                    try:
                        logits = backend.decode_chosen([sequence], choice)
                    except CmpchatError as error:  # e.g. the GPU's context is full: raised after this token's text
                        refused = error
                token = choice.ids()[0]
                # Decode time runs from the first token to the latest, as a reader sees them: a GPU backend's
                # steps are only queued, and the wait for them ends in ids().
                now = time.perf_counter()
                if first_token_at is None:
                    first_token_at = now - start
                    decode_started = now
                else:
                    decode_steps += 1
                    decode_seconds = now - decode_started
                yield from reply.accept(token)
                if decode_steps:
                    yield DecodeProgress(reply.generated, decode_steps / decode_seconds if decode_seconds > 0 else 0.0)
                if reply.done:
                    break
                if cancel is not None and cancel.is_set():
                    reply.cancel()
                    break
                if refused is not None:
                    raise refused
                if not queued:
                    logits = backend.decode([sequence], [token])
            timings = Timings(
                prompt_tokens=len(prompt),
                prompt_seconds=prompt_seconds,
                generated_tokens=reply.generated,
                decode_steps=decode_steps,
                decode_seconds=decode_seconds,
                time_to_first_token=first_token_at if first_token_at is not None else prompt_seconds,
            )
            yield from reply.finish(timings)
        finally:
            backend.release(sequence)
