"""One reply being generated: what happens to each sampled token, whoever drives the steps.

The engine drives many at once, choosing their tokens in one call and decoding them in one backend step,
and feeds each chosen token to its `Reply.accept`, which applies the end tokens, the token budget, stop
strings and output parsing, and keeps the texts and counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cmpchat.chat.messages import Tool
from cmpchat.chat.output_parser import ContentDelta, Event, OutputParser, ReasoningDelta, ToolCallEvent
from cmpchat.engine.constraint import GrammarMatcher
from cmpchat.engine.events import Finished, FinishReason, Timings
from cmpchat.engine.stop import StopStringMatcher
from cmpchat.errors import CmpchatError
from cmpchat.sampling import SamplingParams, TokenLogprobs
from cmpchat.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Limits and sampling for one reply."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    """Most tokens to generate; None runs until an end token or the context is full."""
    stop: tuple[str, ...] = ()
    """Strings that end the reply where they appear; they are not included in it."""
    raw_text: bool = False
    """Return the generated text as it is (plain completions) instead of parsing `<think>` blocks and tool
    calls out of it (chat replies)."""
    ignore_eos: bool = False
    """Keep generating past end tokens (benchmarks on random weights; llama.cpp's ignore_eos)."""
    grammar: str | None = None
    """An llguidance grammar (`engine.constraint`) the reply's tokens must follow; it ends with an end token."""
    logprobs: int | None = None
    """Report each generated token's log-probability and those of this many most likely tokens (None: none)."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("a grammar ends the reply with an end token, so it cannot be combined with ignore_eos")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")


class Reply:
    """The state of one reply: sampling inputs, stop rules, parser, collected output and counts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        options: GenerationOptions,
        context_length: int,
        *,
        starts_in_reasoning: bool = False,
        tools: Sequence[Tool] | None = None,
    ) -> None:
        if not prompt:
            raise CmpchatError("the prompt is empty")
        if len(prompt) >= context_length:
            raise CmpchatError(
                f"the prompt is {len(prompt)} tokens but the model's context holds {context_length}; shorten it"
            )
        self.options = options
        self.prompt_tokens = len(prompt)
        self.budget = context_length - len(prompt)
        if options.max_tokens is not None:
            self.budget = min(self.budget, options.max_tokens)
        self.sampling: SamplingParams = options.sampling
        self.rng = np.random.default_rng(options.sampling.seed)
        self.history: list[int] = list(prompt)
        """Prompt and generated tokens, for the sampling penalties."""
        self.generated = 0
        self.token_ids: list[int] = []
        """Every token accepted, end tokens included."""
        self.finish_reason: FinishReason | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCallEvent] = []
        self._end_tokens = frozenset() if options.ignore_eos else tokenizer.eos_token_ids
        self._decoder = tokenizer.stream_decoder()
        self._stopper = StopStringMatcher(options.stop)
        self._parser = RawText() if options.raw_text else OutputParser(starts_in_reasoning, tools=tools)
        self._grammar = None if options.grammar is None else GrammarMatcher(options.grammar, tokenizer)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_is_last(self) -> bool:
        """Whether the next token is the last the budget allows (no step needs to follow it)."""
        return self.generated + 1 >= self.budget

    def allowed_tokens(self) -> np.ndarray | None:
        """The packed mask of the ids the grammar allows next; None when the reply has no grammar (or is done)."""
        if self._grammar is None or self.done:
            return None
        return self._grammar.allowed()

    def accept(self, token: int, logprobs: TokenLogprobs | None = None) -> list[Event | TokenLogprobs]:
        """Take the next sampled token (and its log-probabilities, when asked for); return the events it makes:
        its log-probabilities first, then the text it completes. Sets `finish_reason` at the end."""
        if self.done:
            raise RuntimeError("Reply.accept after the reply finished")
        self.generated += 1
        self.token_ids.append(token)
        if self._grammar is not None:
            self._grammar.accept(token)
        if token in self._end_tokens:
            self.finish_reason = "stop"
            return []
        self.history.append(token)
        text = self._collect(self._parser.feed(self._stopper.feed(self._decoder.feed(token))))
        events: list[Event | TokenLogprobs] = [logprobs, *text] if logprobs is not None else [*text]
        if self._stopper.stopped:
            self.finish_reason = "stop"
        elif self.generated >= self.budget:
            self.finish_reason = "length"
        return events

    def cancel(self) -> None:
        if not self.done:
            self.finish_reason = "cancelled"

    def finish(self, timings: Timings) -> list[Event | Finished]:
        """Release held-back text and end the reply with its `Finished` event."""
        tail = self._decoder.flush()
        events = self._parser.feed(self._stopper.feed(tail)) + self._parser.feed(self._stopper.flush())
        events = self._collect(events + self._parser.finish())
        reason = self.finish_reason or "length"
        if reason == "stop" and self.tool_calls:
            reason = "tool_calls"
        finished = Finished(
            reason,
            "".join(self.content),
            "".join(self.reasoning),
            tuple(self.tool_calls),
            timings,
            tuple(self.token_ids),
            self._stopper.matched if reason == "stop" else None,
        )
        return [*events, finished]

    def _collect(self, events: list[Event]) -> list[Event]:
        for event in events:
            if isinstance(event, ContentDelta):
                self.content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
            elif isinstance(event, ToolCallEvent):
                self.tool_calls.append(event)
        return events


class RawText:
    """The parser of `raw_text` replies: every piece of text is content, verbatim."""

    def feed(self, text: str) -> list[Event]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []
