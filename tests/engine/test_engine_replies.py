"""One reply through the engine: events, finish reasons, stop rules, cancellation, timings, and the order in
which steps are queued and their tokens read. The scripted backend (tests/scripted_backend.py) makes the model
"say" chosen text, so each rule is checked exactly; the tiny random model checks the loop end to end."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cmpchat.api import open_model
from cmpchat.backends.base import HostLogits, TokenInput
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import ContentDelta, DecodeProgress, Finished, PromptProgress, ReasoningDelta, ToolCallEvent
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import EngineEvent, Failed, GenerationRequest, Started
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams
from cmpchat.tokenizer import Tokenizer
from tests.scripted_backend import FOREVER, ScriptedBackend, ScriptedSequence

Tiny = tuple[ModelConfig, Tokenizer]


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Tiny:
    model_file = ModelFile(tiny_model_path)
    return ModelConfig.from_model_file(model_file), Tokenizer.from_metadata(model_file.metadata)


def engine_for(tiny: Tiny, **backend_options: Any) -> tuple[Engine[ScriptedSequence], ScriptedBackend]:
    config, tokenizer = tiny
    chunk = backend_options.pop("chunk", 512)
    backend = ScriptedBackend(config, tokenizer, **backend_options)
    return Engine(backend, tokenizer, prefill_chunk=chunk), backend


def say(tiny: Tiny, text: str) -> tuple[int, ...]:
    return tuple(tiny[1].encode("SAY:" + text))


def run(
    engine: Engine[ScriptedSequence], prompt: tuple[int, ...], options: GenerationOptions | None = None, **request: Any
) -> tuple[list[EngineEvent], Finished]:
    events = list(engine.generate(GenerationRequest(prompt, options or GenerationOptions(), **request)))
    assert isinstance(events[0], Started)
    finished = events[-1]
    assert isinstance(finished, Finished) and not any(isinstance(e, Finished | Failed) for e in events[:-1])
    return events, finished


def text_of(events: Sequence[EngineEvent], kind: type[ContentDelta | ReasoningDelta]) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def last_finished(events: Sequence[EngineEvent]) -> Finished:
    assert isinstance(events[-1], Finished)
    return events[-1]


def test_content_streams_and_end_token_stops(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny)
    reply_tokens = len(tiny[1].encode("Hello there"))
    prompt = say(tiny, "Hello there")
    events, finished = run(engine, prompt)
    assert text_of(events, ContentDelta) == "Hello there" == finished.content
    assert finished.reason == "stop"
    assert finished.timings.generated_tokens == reply_tokens + 1  # the end token counts
    assert finished.timings.decode_steps == reply_tokens + 1  # the end token's step was queued before it was read
    assert finished.timings.prompt_tokens == len(prompt)
    assert finished.timings.time_to_first_token >= finished.timings.prompt_seconds
    assert sum(isinstance(e, DecodeProgress) for e in events) == reply_tokens


def test_decode_time_covers_the_wait_for_each_token(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny, queued=True, step_delay=0.02)
    _, finished = run(engine, say(tiny, "one two three"))
    timings = finished.timings
    assert timings.decode_seconds >= 0.02 * (timings.generated_tokens - 1)
    assert timings.decode_tokens_per_second <= 55


def test_a_step_is_queued_before_the_token_it_reads_is_read(tiny: Tiny) -> None:
    engine, backend = engine_for(tiny, queued=True, step_delay=0.01)
    text = []
    for event in engine.generate(GenerationRequest(say(tiny, "one two three"), GenerationOptions())):
        if isinstance(event, ContentDelta):
            text.append(event.text)
    log = backend.log
    first_step = log.index("step")
    # prompt, the first token's choice, then the step that reads it before its id is read back
    assert log[: first_step + 2] == ["prefill", "select", "step", "read"]
    # every later choice is queued after the ids before it were read (the penalties see them)
    assert all(log[i - 1] == "read" for i, entry in enumerate(log) if entry == "select" and i > first_step)
    assert "".join(text) == "one two three"


def test_a_failing_step_fails_the_reply_after_the_text_before_it(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, backend = engine_for(tiny)
    decode = backend.decode

    def refuse_the_fourth(
        sequences: Sequence[ScriptedSequence], tokens: Sequence[TokenInput], *, group: int = 0
    ) -> HostLogits:
        if backend.log.count("step") == 3:
            raise CmpchatError("the device's context is full")
        return decode(sequences, tokens, group=group)

    monkeypatch.setattr(backend, "decode", refuse_the_fourth)
    events = list(engine.generate(GenerationRequest(say(tiny, "abcdefgh"), GenerationOptions())))
    assert isinstance(events[-1], Failed) and "context is full" in events[-1].message
    assert text_of(events, ContentDelta) == "abc"
    assert backend.held_sequences == 0


def test_no_step_is_queued_past_the_token_budget(tiny: Tiny) -> None:
    engine, backend = engine_for(tiny, queued=True)
    _, finished = run(engine, say(tiny, "abcdefgh"), GenerationOptions(max_tokens=3))
    assert (finished.content, finished.reason) == ("abc", "length")
    assert backend.log.count("step") == 2  # the third token is only read
    assert finished.timings.decode_steps == 2


def test_a_stop_string_ends_the_reply(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny, queued=True)
    _, finished = run(engine, say(tiny, "one, two. three"), GenerationOptions(stop=(". ",)))
    assert (finished.content, finished.reason) == ("one, two", "stop")


def test_ignore_eos_generates_past_end_tokens(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny)
    _, finished = run(engine, say(tiny, "ab"), GenerationOptions(max_tokens=6, ignore_eos=True))
    assert finished.reason == "length" and finished.timings.generated_tokens == 6
    assert finished.content.startswith("ab")


def test_reasoning_then_tool_call(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny)
    reply = "thinking hard</think>\n\n<tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    events, finished = run(engine, say(tiny, reply), starts_in_reasoning=True)
    assert text_of(events, ReasoningDelta) == "thinking hard" == finished.reasoning
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert [(c.name, c.arguments) for c in calls] == [("get", {"city": "Paris"})]
    assert finished.reason == "tool_calls"


def test_raw_text_keeps_tags_as_content(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny)
    reply = "<think>plan</think> answer <tool_call>\n<function=get>\n</function>\n</tool_call>"
    events, finished = run(engine, say(tiny, reply), GenerationOptions(raw_text=True), starts_in_reasoning=True)
    assert text_of(events, ContentDelta) == reply == finished.content
    assert finished.reasoning == "" and finished.tool_calls == () and finished.reason == "stop"


def test_prefill_runs_in_chunks_with_progress(tiny: Tiny) -> None:
    config, tokenizer = tiny
    backend = ScriptedBackend(config, tokenizer)
    engine = Engine(backend, tokenizer, prefill_chunk=4)
    prompt = say(tiny, "x")[:10] if len(say(tiny, "x")) >= 10 else say(tiny, "x" * 10)[:10]
    events, _ = run(engine, prompt)
    assert backend.log[:3] == ["prefill", "prefill", "prefill"]
    assert [(e.done, e.total) for e in events if isinstance(e, PromptProgress)] == [(4, 10), (8, 10), (10, 10)]


def test_cancel_keeps_what_was_generated(tiny: Tiny) -> None:
    engine, backend = engine_for(tiny)
    cancel = threading.Event()
    seen = []
    request = GenerationRequest(say(tiny, "abcdefghijklmnop" + FOREVER), GenerationOptions())
    for event in engine.generate(request, cancel):
        if isinstance(event, ContentDelta):
            seen.append(event.text)
            if len(seen) == 3:
                cancel.set()
        finished = event
    assert isinstance(finished, Finished) and finished.reason == "cancelled"
    assert finished.content.startswith("abc")
    assert backend.held_sequences == len(engine.prefix_cache)


def test_leaving_the_events_early_cancels_and_frees(tiny: Tiny) -> None:
    engine, backend = engine_for(tiny)
    for event in engine.generate(GenerationRequest(say(tiny, "abc" + FOREVER), GenerationOptions())):
        if isinstance(event, ContentDelta):
            break
    assert engine.running == 0 and engine.waiting == 0
    assert backend.held_sequences == len(engine.prefix_cache)


def test_prompt_longer_than_context_is_refused(tiny: Tiny) -> None:
    engine, _ = engine_for(tiny)
    with pytest.raises(CmpchatError, match="context"):
        list(engine.generate(GenerationRequest((1,) * tiny[0].context_length, GenerationOptions())))


def test_tiny_model_end_to_end(tiny_model_path: Path) -> None:
    from cmpchat.chat.messages import Message

    model = open_model(tiny_model_path)
    greedy = GenerationOptions(max_tokens=12)
    first = last_finished(list(model.chat([Message("user", "hi")], greedy)))
    again = last_finished(list(model.chat([Message("user", "hi")], greedy)))
    assert first.content == again.content and first.timings.generated_tokens >= 1
    sampled = GenerationOptions(max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=3))
    one = last_finished(list(model.chat([Message("user", "hi")], sampled)))
    two = last_finished(list(model.chat([Message("user", "hi")], sampled)))
    assert one.content == two.content


def test_finished_carries_the_generated_token_ids(tiny) -> None:
    engine, backend = engine_for(tiny)
    _, finished = run(engine, say(tiny, "Hi there"))
    assert finished.token_ids == (*tiny[1].encode("Hi there"), backend.end_token)
