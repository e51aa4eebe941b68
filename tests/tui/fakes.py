"""Stand-ins for the engine in app tests: a scripted model whose replies, speeds and timings are fixed,
so Pilot tests are fast and snapshots never change from run to run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from cmpchat.api import Model
from cmpchat.chat.messages import Message, ToolCall
from cmpchat.chat.template import RenderedPrompt
from cmpchat.engine.events import (
    ContentDelta,
    DecodeProgress,
    Finished,
    FinishReason,
    GenerationEvent,
    PromptProgress,
    ReasoningDelta,
    Timings,
    ToolCallEvent,
)
from cmpchat.gpu_readings import GpuStage
from cmpchat.tui.model_request import ModelOpener

ANSWER = (
    "The delta rule updates a memory matrix by writing the error between the value and what the "
    "memory predicts for the key:\n\n```python\nS = a * S + b * outer(k, v - S.T @ k)\n```\n\nThat is all."
)
REASONING = "The user wants two sentences. Recall the Gated DeltaNet update and keep it short."


@dataclass
class Call:
    """What the app asked of the model."""

    messages: list[Message]
    enable_thinking: bool | None
    max_tokens: int | None
    temperature: float | None = None


@dataclass
class ScriptedModel:
    """Answers every chat with `reasoning` (when thinking is on) then `answer`, split in `pieces` deltas.

    `delay` seconds pass between deltas; `gate`, when given, holds the reply after its first delta until
    set (or until cancelled), to test stopping mid-reply; `pace`, when given, holds each delta until
    released once, so a test decides what streams between its steps. `ended` is set when a reply's
    events run out, however they ended.
    """

    answer: str = ANSWER
    reasoning: str = REASONING
    pieces: int = 6
    delay: float = 0.0
    gate: threading.Event | None = None
    pace: threading.Semaphore | None = None
    ended: threading.Event = field(default_factory=threading.Event)
    tool_call: ToolCall | None = None
    is_demo: bool = False
    path: Path = Path("Qwen3.6-27B-Q8_0.gguf")
    supports_images: bool = False
    calls: list[Call] = field(default_factory=list)
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(context_length=262_144))
    backend: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(name="cpu", context_limit=262_144))
    held: object = field(default=None, repr=False, compare=False)
    """Whatever a test wants the model to keep a reference to (itself, for a reference cycle)."""
    stages: list[GpuStage] | None = None
    """What `gpu_stages` answers (None: a backend without pipeline stages, as the CPU reference)."""

    def gpu_stages(self) -> list[GpuStage] | None:
        return self.stages

    def render(self, messages: Sequence[Message], *, tools=None, enable_thinking: bool | None = None) -> RenderedPrompt:
        text = "".join(f"<|im_start|>{m.role}\n{m.text}<|im_end|>\n" for m in messages)
        return RenderedPrompt(text + "<|im_start|>assistant\n", bool(enable_thinking))

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        return list(range(len(text) // 4))

    def chat(
        self,
        messages: Sequence[Message],
        options=None,
        *,
        tools=None,
        enable_thinking: bool | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        temperature = options.sampling.temperature if options is not None else None
        self.calls.append(Call(list(messages), enable_thinking, getattr(options, "max_tokens", None), temperature))
        return self._events(enable_thinking, cancel)

    def _events(self, thinking: bool | None, cancel: threading.Event | None) -> Iterator[GenerationEvent]:
        try:
            yield from self._script(thinking, cancel)
        finally:
            self.ended.set()

    def _script(self, thinking: bool | None, cancel: threading.Event | None) -> Iterator[GenerationEvent]:
        prompt_tokens = 18_204
        yield PromptProgress(4_096, prompt_tokens, 812.0)
        yield PromptProgress(prompt_tokens, prompt_tokens, 812.0)
        deltas: list[GenerationEvent] = []
        if thinking:
            deltas += [ReasoningDelta(part) for part in _split(self.reasoning, 2)]
        deltas += [ContentDelta(part) for part in _split(self.answer, self.pieces)]
        if self.tool_call is not None:
            deltas.append(ToolCallEvent(self.tool_call))
        content: list[str] = []
        reasoning: list[str] = []
        generated = 0
        reason: FinishReason = "stop"
        for index, delta in enumerate(deltas):
            if self.pace is not None:
                while not self.pace.acquire(timeout=0.01):
                    if cancel is not None and cancel.is_set():
                        break
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
            elif isinstance(delta, ReasoningDelta):
                reasoning.append(delta.text)
            generated += 10
            yield delta
            yield DecodeProgress(generated, 27.4)
            if index == 0 and self.gate is not None:
                while not self.gate.wait(0.01):
                    if cancel is not None and cancel.is_set():
                        break
            if self.delay:
                time.sleep(self.delay)
        timings = Timings(
            prompt_tokens=prompt_tokens,
            prompt_seconds=prompt_tokens / 812.0,
            generated_tokens=generated,
            decode_steps=generated,
            decode_seconds=generated / 27.4,
            time_to_first_token=1.42,
        )
        calls = (ToolCallEvent(self.tool_call),) if self.tool_call is not None and reason == "stop" else ()
        yield Finished(reason, "".join(content), "".join(reasoning), calls, timings)


def scripted_opener(make: Callable[[Path | None], ScriptedModel]) -> ModelOpener:
    """An opener for the app (`cmpchat.open_model`'s shape) that gives what `make` returns for the path asked for."""

    def open_scripted(
        path: Path | None, *, backend: str, progress: Callable[[str, int, int], None], **options: Any
    ) -> Model:
        return cast(Model, make(path))  # the app uses only what a ScriptedModel has

    return open_scripted


def _split(text: str, pieces: int) -> list[str]:
    size = max(1, -(-len(text) // pieces))
    return [text[i : i + size] for i in range(0, len(text), size)]
