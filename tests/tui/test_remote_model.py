"""The remote model's pieces without a server: reading chunks into engine events, where the speed figures
come from, inline `<think>` tags, the request body and the one-line errors."""

from __future__ import annotations

import json

import httpx
import pytest

from cmpchat.chat.messages import Message, ToolCall
from cmpchat.engine.events import ContentDelta, DecodeProgress, Finished, ReasoningDelta, ToolCallEvent
from cmpchat.engine.reply import GenerationOptions
from cmpchat.sampling import SamplingParams
from cmpchat.tui.remote_model import InlineThink, StreamReading, chat_body, refusal
from tests.tui.openai_stub import chunk, usage_chunk


def final(reading: StreamReading) -> Finished:
    *_, finished = reading.ending("stop")
    assert isinstance(finished, Finished)
    return finished


def feed(reading: StreamReading, *chunks: dict) -> list:
    return [event for c in chunks for event in reading.feed_line("data: " + json.dumps(c))]


def test_chunks_become_reasoning_content_and_progress_events():
    reading = StreamReading(started=0.0)
    events = feed(
        reading, chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "hm"}), chunk({"content": "Hi"})
    )
    assert [e for e in events if not isinstance(e, DecodeProgress)] == [ReasoningDelta("hm"), ContentDelta("Hi")]
    assert [e.generated_tokens for e in events if isinstance(e, DecodeProgress)] == [1, 2]
    reading.feed_line(": a comment line")
    list(reading.feed_line("data: [DONE]"))
    assert reading.done and (reading.reasoning, reading.content) == ("hm", "Hi")


def test_the_servers_timings_win_over_usage_and_the_clients_clock():
    reading = StreamReading(started=0.0)
    feed(reading, chunk({"content": "a"}), chunk({"content": "b"}))
    timings = {"prompt_n": 40, "prompt_ms": 200.0, "predicted_n": 12, "predicted_ms": 400.0}
    feed(reading, {**chunk({}, finish="stop"), "timings": timings}, usage_chunk(prompt=41, completion=13))
    t = final(reading).timings
    assert (t.prompt_tokens, t.generated_tokens) == (40, 12)
    assert t.prompt_tokens_per_second == pytest.approx(200.0) and t.decode_tokens_per_second == pytest.approx(30.0)


def test_without_timings_usage_counts_and_the_client_times():
    reading = StreamReading(started=0.0)
    feed(reading, chunk({"content": "a"}))
    reading.first_text, reading.last_text = 1.0, 3.0  # the first and last text came 2 s apart
    feed(reading, usage_chunk(prompt=7, completion=21))
    t = final(reading).timings
    assert (t.prompt_tokens, t.generated_tokens, t.time_to_first_token) == (7, 21, 1.0)
    assert t.decode_tokens_per_second == pytest.approx(10.0)  # 20 tokens after the first, in 2 s


def test_tool_calls_are_assembled_from_their_pieces():
    reading = StreamReading(started=0.0)
    start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
    feed(
        reading,
        chunk({"tool_calls": [start]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, finish="tool_calls"),
    )
    *calls, finished = reading.ending(reading.finish_reason)
    assert calls == [ToolCallEvent(ToolCall("weather", {"city": "Oslo"}, "call_1"))]
    assert isinstance(finished, Finished) and finished.reason == "tool_calls" and finished.tool_calls == tuple(calls)
    *_, stopped = reading.ending("cancelled")
    assert isinstance(stopped, Finished) and stopped.tool_calls == ()


def test_only_a_reply_that_opens_with_think_has_reasoning_split_off():
    inline = InlineThink()
    events = [e for text in ["Use ", "<think>", " tags"] for e in inline.split(text)]
    assert events == [ContentDelta("Use "), ContentDelta("<think>"), ContentDelta(" tags")]
    inline = InlineThink()
    assert inline.split("  <thi") == [] and inline.split("nk>a</think") == [ReasoningDelta("a")]
    assert inline.split(">b") == [ContentDelta("b")]
    held = StreamReading(started=0.0)
    assert feed(held, chunk({"content": "<th"})) == []
    assert list(held.ending("stop"))[0] == ContentDelta("<th")  # a reply that was only the start of a tag


def test_the_request_sends_extensions_only_when_they_say_something():
    messages = [Message("user", "hi")]
    plain = chat_body("m", messages, GenerationOptions(), None)
    assert "top_k" not in plain and "seed" not in plain and "chat_template_kwargs" not in plain
    assert "max_tokens" not in plain and plain["stream_options"] == {"include_usage": True}
    options = GenerationOptions(SamplingParams(temperature=0.7, top_k=20, seed=3), max_tokens=64)
    full = chat_body("m", messages, options, False)
    assert (full["top_k"], full["seed"], full["max_tokens"], full["temperature"]) == (20, 3, 64, 0.7)
    assert full["chat_template_kwargs"] == {"enable_thinking": False}


def test_a_refusal_is_one_line_with_what_the_server_said():
    denied = httpx.Response(401, json={"error": {"message": "Invalid key"}})
    assert refusal(denied) == "the server answered 401 Unauthorized (give the server's key with --api-key): Invalid key"
    broken = httpx.Response(502, text="<html>\nBad gateway\n</html>")
    assert refusal(broken) == "the server answered 502 Bad Gateway: <html>"
