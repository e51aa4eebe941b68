"""Anthropic's Messages API through the official anthropic client, against a live server over the scripted backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from anthropic.types import (
    MessageParam,
    RawMessageStreamEvent,
    TextBlock,
    ThinkingBlock,
    ToolParam,
    ToolUseBlock,
)

from cmpchat.server.settings import ServerSettings
from tests.scripted_backend import EXPLODE
from tests.server.conftest import API_KEY, scripted_model
from tests.server.live import LiveServer, live_server
from tests.server.test_server_chat import CALL, last_prompt, reply_tokens

TOOLS: list[ToolParam] = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


def anthropic_client(server: LiveServer, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(scripted_server: LiveServer) -> anthropic.Anthropic:
    return anthropic_client(scripted_server)


def user(text: str) -> list[MessageParam]:
    return [{"role": "user", "content": text}]


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def test_plain_message(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    message = claude.messages.create(model="m", max_tokens=100, messages=user("SAY:Hello there"))
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and text_of(message) == "Hello there"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.model == "scripted"
    assert message.usage.output_tokens == reply_tokens(scripted_server, "Hello there")
    assert (message.model_extra or {})["timings"]["prompt_n"] == message.usage.input_tokens


def test_system_prompt(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    claude.messages.create(
        model="m", max_tokens=10, system=[{"type": "text", "text": "Be brief."}], messages=user("SAY:ok")
    )
    assert last_prompt(scripted_server).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSAY:ok")


def test_usage_counts_the_prompt_with_its_cached_part(claude: anthropic.Anthropic) -> None:
    messages = user("SAY:First answer.")
    first = claude.messages.create(model="m", max_tokens=50, messages=messages)
    count = claude.messages.count_tokens(model="m", messages=messages).input_tokens
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == count
    messages += [{"role": "assistant", "content": text_of(first)}, *user("SAY:Second.")]
    second = claude.messages.create(model="m", max_tokens=50, messages=messages)
    assert (second.usage.cache_read_input_tokens or 0) > 0
    assert (
        second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
        == claude.messages.count_tokens(model="m", messages=messages).input_tokens
    )


def events_of(claude: anthropic.Anthropic, **fields) -> list[RawMessageStreamEvent]:
    return list(claude.messages.create(model="m", max_tokens=100, stream=True, **fields))


def test_streamed_message_follows_the_event_contract(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    events = events_of(claude, messages=user("SAY:Hello there"))
    types = [event.type for event in events]
    assert types[0] == "message_start" and types[1] == "content_block_start"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    text = "".join(
        event.delta.text for event in events if event.type == "content_block_delta" and event.delta.type == "text_delta"
    )
    assert text == "Hello there"
    delta = events[-2]
    assert delta.type == "message_delta" and delta.delta.stop_reason == "end_turn"
    assert delta.usage.output_tokens == reply_tokens(scripted_server, "Hello there")


def test_the_raw_stream_names_every_event_and_pings(scripted_server: LiveServer) -> None:
    body = {"model": "m", "max_tokens": 10, "messages": user("SAY:Hi"), "stream": True}
    with httpx.stream("POST", scripted_server.url + "/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert len(names) * 2 == len(lines) and names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_the_clients_stream_helper_rebuilds_the_message(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="m",
        max_tokens=100,
        messages=user("SAY:Hmm.</think>\n\nYes."),
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        final = stream.get_final_message()
    thinking, text = final.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Hmm."
    assert isinstance(text, TextBlock) and text.text == "Yes."


def test_thinking_enabled_and_disabled(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    thought = claude.messages.create(
        model="m",
        max_tokens=100,
        messages=user("SAY:Let me think.</think>\n\nThe answer is 4."),
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert last_prompt(scripted_server).endswith("<|im_start|>assistant\n<think>\n")
    thinking, text = thought.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Let me think."
    assert isinstance(text, TextBlock) and text.text == "The answer is 4."
    plain = claude.messages.create(
        model="m", max_tokens=100, messages=user("SAY:Plain."), thinking={"type": "disabled"}
    )
    assert last_prompt(scripted_server).endswith("<think>\n\n</think>\n\n")
    assert [block.type for block in plain.content] == ["text"]
    events = events_of(
        claude, messages=user("SAY:Hmm.</think>\n\nYes."), thinking={"type": "enabled", "budget_tokens": 1024}
    )
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Hmm."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "Yes."


def test_thinking_blocks_of_earlier_turns_are_read(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    messages: list[MessageParam] = [
        *user("first"),
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Earlier thought.", "signature": ""},
                {"type": "text", "text": "Earlier answer."},
            ],
        },
        *user("SAY:next"),
    ]
    claude.messages.create(model="m", max_tokens=10, messages=messages)
    assert "Earlier answer." in last_prompt(scripted_server)


def test_tool_use_round_trip(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    messages = user("SAY:" + CALL)
    first = claude.messages.create(model="m", max_tokens=200, messages=messages, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert isinstance(call, ToolUseBlock)
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 2}

    messages += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "SAY:It will be sunny in Paris."},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    final = claude.messages.create(model="m", max_tokens=200, messages=messages, tools=TOOLS)
    assert final.stop_reason == "end_turn" and text_of(final) == "It will be sunny in Paris."
    prompt = last_prompt(scripted_server)
    assert "<tool_response>\nSAY:It will be sunny in Paris.\n</tool_response>" in prompt
    assert prompt.index("</tool_response>") < prompt.index("And tomorrow?")


def test_streamed_tool_use(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="m", max_tokens=200, messages=user("SAY:" + CALL), tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [(block.type, getattr(block, "name", None)) for block in starts] == [("tool_use", "get_weather")]
    (call,) = final.content
    assert isinstance(call, ToolUseBlock) and call.input == {"city": "Paris", "days": 2}
    assert final.stop_reason == "tool_use"


def test_tool_choice(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    claude.messages.create(model="m", max_tokens=10, messages=user("SAY:ok"), tools=TOOLS, tool_choice={"type": "none"})
    assert "get_weather" not in last_prompt(scripted_server)
    claude.messages.create(
        model="m",
        max_tokens=10,
        messages=user("SAY:ok"),
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert "get_weather" in last_prompt(scripted_server)


def test_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    stopped = claude.messages.create(
        model="m", max_tokens=100, messages=user("SAY:one, two. three"), stop_sequences=["three", ". "]
    )
    assert text_of(stopped) == "one, two"
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", ". ")
    unmatched = claude.messages.create(model="m", max_tokens=100, messages=user("SAY:one"), stop_sequences=["never"])
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)
    short = claude.messages.create(
        model="m",
        max_tokens=3,
        messages=user("SAY:abcdefgh"),
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5},
    )
    assert (text_of(short), short.stop_reason, short.usage.output_tokens) == ("abc", "max_tokens", 3)
    events = events_of(claude, messages=user("SAY:one, two. three"), stop_sequences=[". "])
    delta = events[-2]
    assert delta.type == "message_delta"
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", ". ")


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, fragment: str = "") -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and fragment in body["error"]["message"], body


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "source.type"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "aGk="}}]}
                ]
            },
            "no vision projector",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "text and images only"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "user turn",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tool_choice": {"type": "tool", "name": "g"}, "tools": TOOLS}, "not among the tools"),
        ({"temperature": 1.5}, "temperature"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"messages": [{"role": "user", "content": "z" * 5000}]}, "context"),
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(scripted_server: LiveServer, fields: dict, fragment: str) -> None:
    body = {"model": "m", "max_tokens": 10, "messages": user("hi"), **fields}
    body = {key: value for key, value in body.items() if value is not None}
    response = httpx.post(scripted_server.url + "/v1/messages", json=body, timeout=30)
    assert_anthropic_error(response, 400, "invalid_request_error", fragment)


def test_malformed_bodies_and_the_client_error(claude: anthropic.Anthropic, scripted_server: LiveServer) -> None:
    response = httpx.post(scripted_server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert_anthropic_error(response, 400, "invalid_request_error", "not valid JSON")
    assert_anthropic_error(httpx.get(scripted_server.url + "/v1/messages"), 405, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=10, messages=[])
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "error"


def test_a_failing_backend_is_an_api_error(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.InternalServerError, match="the device fell off the bus") as caught:
        claude.messages.create(model="m", max_tokens=10, messages=user("SAY:" + EXPLODE))
    assert isinstance(caught.value.body, dict) and caught.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError, match="the device fell off the bus"):
        events_of(claude, messages=user("SAY:" + EXPLODE))


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path)
    with live_server(ServerSettings(port=0, api_key=API_KEY), lambda: model) as server:
        yield server


def test_the_api_key_goes_in_x_api_key(keyed_server: LiveServer) -> None:
    message = anthropic_client(keyed_server, API_KEY).messages.create(model="m", max_tokens=10, messages=user("SAY:in"))
    assert text_of(message) == "in"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic_client(keyed_server, "wrong").messages.create(model="m", max_tokens=10, messages=user("SAY:in"))
    assert isinstance(caught.value.body, dict) and caught.value.body["error"]["type"] == "authentication_error"
    refused = httpx.post(keyed_server.url + "/v1/messages/count_tokens", json={"messages": user("hi")})
    assert_anthropic_error(refused, 401, "authentication_error", "X-Api-Key")
