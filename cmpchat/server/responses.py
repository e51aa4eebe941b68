"""Response bodies and stream chunks of the OpenAI chat and completions APIs, built from engine events.

Besides `usage`, every response carries `timings` with llama-server's field names (prompt_n,
prompt_per_second, predicted_per_second, cache_n, ...), so tools written for llama-server read them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import ContentDelta, Finished, ReasoningDelta, ToolCallEvent
from cmpchat.engine.request import EngineEvent, Failed, Started
from cmpchat.sampling import TokenLogprobs
from cmpchat.server.errors import error_body
from cmpchat.server.logprobs import LogprobRouter, LogprobShapes

Kind = Literal["chat", "text"]
_PREFIX: dict[Kind, str] = {"chat": "chatcmpl-", "text": "cmpl-"}
_OBJECT: dict[Kind, str] = {"chat": "chat.completion", "text": "text_completion"}


@dataclass(slots=True)
class Outcome:
    """What the engine said about one request, gathered from its events."""

    prompt_tokens: int
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    finished: Finished | None = None
    failure: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    """Every generated token's log-probabilities, when the request asked for them (else None)."""
    content_logprobs: list[TokenLogprobs] = field(default_factory=list, init=False)
    """Of those, the tokens whose text went to the answer (content deltas, as `LogprobRouter` routes them): not
    the reasoning's, the tool calls', or those no text followed."""
    _router: LogprobRouter = field(default_factory=LogprobRouter, init=False, repr=False)

    @property
    def done(self) -> bool:
        return self.finished is not None or self.failure is not None

    def absorb(self, event: EngineEvent) -> None:
        if isinstance(event, Started):
            self.cached_tokens, self.queue_seconds = event.cached_tokens, event.queue_seconds
        elif isinstance(event, Finished):
            self.finished = event
        elif isinstance(event, Failed):
            self.failure = event.message
        if self.logprobs is None:
            return
        if isinstance(event, TokenLogprobs):
            self.logprobs.append(event)
        taken = self._router.route(event)
        if isinstance(event, ContentDelta):
            self.content_logprobs += taken

    def error(self) -> tuple[int, str] | None:
        """(status, message) when the request did not finish normally."""
        if self.failure is not None:
            return 500, f"generation failed: {self.failure}"
        if self.finished is not None and self.finished.reason == "cancelled":
            return 503, "the request was cancelled because the server is shutting down"
        return None

    def usage(self) -> dict[str, Any]:
        completion = self.finished.timings.generated_tokens if self.finished else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def timings(self) -> dict[str, Any]:
        t = self.finished.timings if self.finished else None
        prompt_ms = t.prompt_seconds * 1000 if t else 0.0
        decode_ms = t.decode_seconds * 1000 if t else 0.0
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": t.prompt_tokens if t else 0,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / t.prompt_tokens if t and t.prompt_tokens else 0.0,
            "prompt_per_second": t.prompt_tokens_per_second if t else 0.0,
            "predicted_n": t.generated_tokens if t else 0,
            "predicted_ms": decode_ms,
            "predicted_per_token_ms": decode_ms / t.decode_steps if t and t.decode_steps else 0.0,
            "predicted_per_second": t.decode_tokens_per_second if t else 0.0,
            "time_to_first_token_ms": t.time_to_first_token * 1000 if t else 0.0,
            "queue_ms": self.queue_seconds * 1000,
        }


def finish_reason(finished: Finished) -> str:
    return "stop" if finished.reason == "cancelled" else finished.reason


def tool_call_object(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }
    return body if index is None else {"index": index, **body}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying `data` (JSON, or a literal such as [DONE])."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


def named_sse(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event named `kind` whose JSON data carries `"type": kind` first (the Responses and
    Messages APIs' streams)."""
    text = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {text}\n\n"


@dataclass(slots=True)
class ResponseHeader:
    """The fields every body and chunk of one response repeats."""

    kind: Kind
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or _PREFIX[self.kind] + secrets.token_hex(12)

    def fields(self, *, chunk: bool) -> dict[str, Any]:
        kind = _OBJECT[self.kind] + (".chunk" if chunk and self.kind == "chat" else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def chat_completion_body(header: ResponseHeader, outcome: Outcome, shapes: LogprobShapes) -> dict[str, Any]:
    finished = outcome.finished
    assert finished is not None
    message: dict[str, Any] = {"role": "assistant", "content": finished.content or None}
    if finished.reasoning:
        message["reasoning_content"] = finished.reasoning
    if finished.tool_calls:
        message["tool_calls"] = [tool_call_object(event.call) for event in finished.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    logprobs = None if outcome.logprobs is None else shapes.chat(outcome.logprobs)
    choice = {"index": 0, "message": message, "finish_reason": finish_reason(finished), "logprobs": logprobs}
    return {**header.fields(chunk=False), "choices": [choice], "usage": outcome.usage(), "timings": outcome.timings()}


def text_completion_body(header: ResponseHeader, outcome: Outcome, shapes: LogprobShapes) -> dict[str, Any]:
    finished = outcome.finished
    assert finished is not None
    # Without a chat template there is no reasoning block to split off: it is part of the text.
    choice = {
        "index": 0,
        "text": finished.reasoning + finished.content,
        "finish_reason": finish_reason(finished),
        "logprobs": None if outcome.logprobs is None else shapes.completion(outcome.logprobs, 0),
    }
    return {**header.fields(chunk=False), "choices": [choice], "usage": outcome.usage(), "timings": outcome.timings()}


class ChunkWriter:
    """The chunks of one streamed response, from engine event batches (OpenAI's chunk contract):
    the first chat chunk carries the role, all share one id, the last one with choices carries the
    finish reason and timings, then a usage chunk if asked for, then `[DONE]`."""

    def __init__(self, header: ResponseHeader, outcome: Outcome, shapes: LogprobShapes, *, include_usage: bool) -> None:
        self.header = header
        self.outcome = outcome
        self.shapes = shapes
        self.include_usage = include_usage
        self._tool_calls = 0
        self._router = LogprobRouter()
        """Log-probabilities of tokens whose text has not gone out yet (held back by the parser or stop rules)."""
        self._text_offset = 0

    def opening(self) -> list[str]:
        if self.header.kind == "chat":
            return [self._chunk({"role": "assistant", "content": ""})]
        return []

    def feed(self, events: Sequence[EngineEvent]) -> list[str]:
        out: list[str] = []
        for delta, logprobs in self._deltas(events):
            out.append(self._chunk(delta, logprobs=logprobs))
        for event in events:
            self.outcome.absorb(event)
        if self.outcome.done:
            out.extend(self._closing())
        return out

    def _deltas(self, events: Sequence[EngineEvent]) -> list[tuple[dict[str, Any], list[TokenLogprobs]]]:
        """One delta per run of same-kind text, one per tool call; each with the log-probabilities of the tokens
        whose text it is the first to carry."""
        deltas: list[tuple[dict[str, Any], list[TokenLogprobs]]] = []
        for event in events:
            if isinstance(event, ToolCallEvent) and self.header.kind != "chat":
                continue  # raw text has none
            taken = self._router.route(event)
            if isinstance(event, ToolCallEvent):
                deltas.append(({"tool_calls": [tool_call_object(event.call, self._tool_calls)]}, taken))
                self._tool_calls += 1
                continue
            if not isinstance(event, ReasoningDelta | ContentDelta):
                continue
            key = "reasoning_content" if isinstance(event, ReasoningDelta) else "content"
            if self.header.kind == "text":
                key = "text"
            if deltas and set(deltas[-1][0]) == {key}:
                deltas[-1][0][key] += event.text
                deltas[-1][1].extend(taken)
            else:
                deltas.append(({key: event.text}, taken))
        return deltas

    def _chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        **extra: Any,
    ) -> str:
        shaped = None
        if self.outcome.logprobs is not None:
            if self.header.kind == "chat":
                shaped = self.shapes.chat(logprobs or [])
            else:
                shaped = self.shapes.completion(logprobs or [], self._text_offset)
                self._text_offset += self.shapes.text_length(logprobs or [])
        if self.header.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": shaped}
        else:
            choice = {"index": 0, "text": delta.get("text", ""), "finish_reason": finish, "logprobs": shaped}
        body = {**self.header.fields(chunk=True), "choices": [choice], **extra}
        if self.include_usage:
            body.setdefault("usage", None)
        return sse(body)

    def broken(self) -> list[str]:
        return [
            sse(error_body(500, "internal server error while streaming; the server log has the details")),
            sse("[DONE]"),
        ]

    def _closing(self) -> list[str]:
        error = self.outcome.error()
        if error is not None:
            return [sse(error_body(*error)), sse("[DONE]")]
        assert self.outcome.finished is not None
        finish = finish_reason(self.outcome.finished)
        out = [self._chunk({}, finish, logprobs=self._router.take(), timings=self.outcome.timings())]
        if self.include_usage:
            out.append(sse({**self.header.fields(chunk=True), "choices": [], "usage": self.outcome.usage()}))
        out.append(sse("[DONE]"))
        return out
