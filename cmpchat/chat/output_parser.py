"""Splitting streamed model output into reasoning, answer text and tool calls.

The generator feeds decoded text deltas (special tokens such as `<think>` arrive as their text) and gets
events back. Text is released as soon as it cannot be the start of a tag, so a tag split across deltas at
any character is still recognised while ordinary text streams without delay.

Whitespace: a section (reasoning, or the answer) never starts with whitespace, and whitespace before a
section ends (`</think>`, a tool call, the end of output) is dropped; whitespace inside a section is
released together with the text that follows it. Nothing else is ever dropped: a tool call that does not
parse, or is never closed, comes out as answer text, tags included.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from cmpchat.chat.messages import Tool, ToolCall
from cmpchat.chat.tags import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN
from cmpchat.chat.tool_calls import parameter_types, parse_tool_call


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """More text of the model's reasoning."""

    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """More text of the answer."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    """A complete, parsed tool call."""

    call: ToolCall


Event = ReasoningDelta | ContentDelta | ToolCallEvent


class _Section(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALL = "tool_call"


def new_call_id() -> str:
    """A fresh tool call id in the OpenAI style."""
    return "call_" + secrets.token_hex(12)


class OutputParser:
    """Incremental parser for one generated assistant turn.

    `starts_in_reasoning` says whether the prompt already opened a `<think>` block (see
    `RenderedPrompt.thinking`). `tools` gives parameter types for tool call arguments; `id_factory`
    makes tool call ids (tests pass a deterministic one).
    """

    def __init__(
        self,
        starts_in_reasoning: bool,
        *,
        tools: Sequence[Tool] | None = None,
        id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self._section = _Section.REASONING if starts_in_reasoning else _Section.CONTENT
        self._types = parameter_types(tools)
        self._new_id = id_factory
        self._buffer = ""  # text not yet released: a possible tag prefix, or an open tool call's body
        self._call_scan_from = 0  # where to resume looking for CALL_CLOSE in an open call's body
        self._space = ""  # whitespace held until more text of the same section follows
        self._space_before_call = ""  # given back if the call turns out not to be one
        self._started = {_Section.REASONING: False, _Section.CONTENT: False}
        self._at_output_start = True  # nothing but whitespace so far: a stray <think> may still come
        self._events: list[Event] = []
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        """Take the next piece of generated text; return the events it completes."""
        if self._finished:
            raise RuntimeError("OutputParser.feed called after finish")
        self._buffer += text
        self._process(final=False)
        return self._take_events()

    def finish(self) -> list[Event]:
        """End of output: release what was held back and return the last events."""
        if not self._finished:
            self._finished = True
            self._process(final=True)
            self._space = ""
        return self._take_events()

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _process(self, *, final: bool) -> None:
        while True:
            if self._section is _Section.TOOL_CALL:
                if not self._close_call(final=final):
                    return
                continue
            tags = self._tags()
            position, tag = _earliest(self._buffer, tags)
            if tag is None:
                held = 0 if final else _partial_tag_length(self._buffer, tags)
                self._release(self._buffer[: len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held :]
                return
            self._release(self._buffer[:position])
            if tag == THINK_OPEN and not self._at_output_start:
                self._buffer = self._buffer[position:]  # text came first: this <think> is just text
                continue
            self._buffer = self._buffer[position + len(tag) :]
            self._enter_tag(tag)

    def _tags(self) -> tuple[str, ...]:
        if self._section is _Section.REASONING:
            tags: tuple[str, ...] = (THINK_CLOSE, CALL_OPEN)
        else:
            tags = (CALL_OPEN,)
        return (*tags, THINK_OPEN) if self._at_output_start else tags

    def _enter_tag(self, tag: str) -> None:
        self._at_output_start = False
        if tag == THINK_OPEN:
            # A model that opens <think> itself; also a repeated one after the prompt's own.
            self._section = _Section.REASONING
            self._space = ""
        elif tag == THINK_CLOSE:
            self._section = _Section.CONTENT
            self._space = ""
        else:
            # A call while still reasoning ends the reasoning too: the call is meant to be run.
            self._section = _Section.TOOL_CALL
            self._space_before_call, self._space = self._space, ""
            self._call_scan_from = 0

    def _close_call(self, *, final: bool) -> bool:
        """Finish an open tool call if its closing tag has arrived (or output ended); False if still open."""
        end = self._buffer.find(CALL_CLOSE, self._call_scan_from)
        if end < 0:
            if not final:
                self._call_scan_from = max(0, len(self._buffer) - len(CALL_CLOSE) + 1)
                return False
            self._section = _Section.CONTENT
            self._release(self._space_before_call + CALL_OPEN + self._buffer)
            self._buffer = ""
            return True
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(CALL_CLOSE) :]
        self._section = _Section.CONTENT
        parsed = parse_tool_call(body, self._types)
        if parsed is None:
            self._release(self._space_before_call + CALL_OPEN + body + CALL_CLOSE)
        else:
            name, arguments = parsed
            self._events.append(ToolCallEvent(ToolCall(name=name, arguments=arguments, id=self._new_id())))
        return True

    def _release(self, text: str) -> None:
        """Emit `text` in the current section, holding back its trailing whitespace."""
        if not text:
            return
        section = self._section
        pending = self._space + text
        body = pending.rstrip()
        self._space = pending[len(body) :]
        if not body:
            return
        if not self._started[section]:
            body = body.lstrip()
            self._started[section] = True
        self._at_output_start = False
        self._emit(ReasoningDelta(body) if section is _Section.REASONING else ContentDelta(body))

    def _emit(self, event: ReasoningDelta | ContentDelta) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is type(event):
            self._events[-1] = type(event)(last.text + event.text)
        else:
            self._events.append(event)


def _earliest(text: str, tags: Sequence[str]) -> tuple[int, str | None]:
    """The first tag occurring in `text` and its position, or (-1, None)."""
    best_position, best_tag = -1, None
    for tag in tags:
        position = text.find(tag)
        if position >= 0 and (best_tag is None or position < best_position):
            best_position, best_tag = position, tag
    return best_position, best_tag


def _partial_tag_length(text: str, tags: Sequence[str]) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags`."""
    longest = min(len(text), max(len(tag) for tag in tags) - 1)
    for length in range(longest, 0, -1):
        suffix = text[-length:]
        if any(tag.startswith(suffix) for tag in tags):
            return length
    return 0
