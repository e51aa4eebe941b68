"""Structured output through the official openai client on random models (the tiny one, and the demo model with
the real Qwen3.5 vocabulary): `parse()` with a bounded pydantic model, JSON mode, forced tool calls, and the 400s
of schemas that cannot be enforced."""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import StrEnum
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionToolParam
from pydantic import BaseModel, Field

from cmpchat.api import open_model
from cmpchat.demo import ensure_demo_model
from cmpchat.server.settings import ServerSettings
from tests.server.conftest import client_for
from tests.server.live import LiveServer, live_server

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "days", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}},
        },
    },
]


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Answer(BaseModel):
    color: Color
    count: int = Field(ge=0, le=99)
    label: str = Field(max_length=8)
    ok: bool


@pytest.fixture(scope="module")
def client(tiny_server: LiveServer) -> openai.OpenAI:
    return client_for(tiny_server)


@pytest.fixture(scope="module")
def demo_server() -> Iterator[LiveServer]:
    path = ensure_demo_model()
    with live_server(ServerSettings(port=0, slots=2), lambda: open_model(path, sequences=2)) as server:
        yield server


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parse_returns_a_valid_bounded_object(client: openai.OpenAI, seed: int) -> None:
    check_parse(client, seed)


@pytest.mark.slow
def test_parse_returns_a_valid_bounded_object_on_the_demo_model(demo_server: LiveServer) -> None:
    for seed in (1, 2):
        check_parse(client_for(demo_server), seed)


def check_parse(client: openai.OpenAI, seed: int) -> None:
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Pick a color."}],
        response_format=Answer,
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, Answer)
    assert Answer.model_validate_json(choice.message.content or "") == parsed


def test_parse_streams_the_same_object(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="tiny", messages=[{"role": "user", "content": "Go."}], response_format=Answer, seed=4, max_tokens=200
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)


def test_json_object_mode_answers_a_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=5,
        temperature=1.0,
    )
    content = completion.choices[0].message.content or ""
    if completion.choices[0].finish_reason == "stop":  # an unbounded object may run to the limit
        assert isinstance(json.loads(content), dict)
    assert content.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_returns_a_tool_call(client: openai.OpenAI, choice) -> None:
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS[:1],
        tool_choice=choice,
        max_tokens=200,
        seed=6,
        temperature=1.0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = cast(ChatCompletionMessageFunctionToolCall, message.tool_calls[0])
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days", "unit"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
    assert arguments["days"] in range(1, 8) and arguments["unit"] in ("celsius", "fahrenheit")


def test_a_named_choice_among_tools_calls_that_tool_in_json_form_when_xml_cannot_bound_it(
    client: openai.OpenAI,
) -> None:
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Time?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        seed=7,
        temperature=1.0,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    call = cast(ChatCompletionMessageFunctionToolCall, calls[0])
    assert call.function.name == "get_time"
    zone = json.loads(call.function.arguments).get("zone")
    assert zone is None or (len(zone) == 3 and zone.isupper())


def test_an_invalid_schema_is_one_clear_400(tiny_server: LiveServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}},
    }
    reply = httpx.post(f"{tiny_server.api}/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"].startswith("response_format.json_schema.schema: ")
    assert "strin" in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "a JSON schema is required"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
            "cannot be combined",
        ),
    ],
)
def test_structured_requests_that_cannot_be_served_are_400s(tiny_server: LiveServer, body: dict, says: str) -> None:
    reply = httpx.post(
        f"{tiny_server.api}/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body}, timeout=30
    )
    assert reply.status_code == 400
    assert says in reply.json()["error"]["message"]


def test_responses_parse_returns_a_valid_bounded_object(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model="tiny", input="Pick a color.", text_format=Answer, temperature=1.0, max_output_tokens=200
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Answer)


def test_responses_forced_tool_choice_returns_a_function_call(client: openai.OpenAI) -> None:
    tool = TOOLS[0]["function"]
    response = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=[{"type": "function", "name": tool["name"], "parameters": tool.get("parameters"), "strict": False}],
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=200,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city", "days", "unit"}


@pytest.mark.parametrize(
    ("text_format", "says"),
    [
        ({"type": "json_schema", "name": "x", "schema": {"type": "strin"}}, "text.format.schema: "),
        ({"type": "json_schema", "name": "x"}, "a JSON schema is required"),
        ({"type": "grammar"}, "not supported"),
    ],
)
def test_responses_text_formats_that_cannot_be_served_are_400s(
    tiny_server: LiveServer, text_format: dict, says: str
) -> None:
    body = {"input": "x", "text": {"format": text_format}}
    reply = httpx.post(f"{tiny_server.api}/responses", json=body, timeout=30)
    assert reply.status_code == 400
    assert says in reply.json()["error"]["message"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_messages_forced_tool_choice_returns_a_tool_use(tiny_server: LiveServer, choice: dict) -> None:
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0, timeout=30)
    tool = TOOLS[0]["function"]
    message = claude.messages.create(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": tool["name"], "input_schema": cast(dict, tool.get("parameters"))}],
        tool_choice=cast(Any, choice),
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert set(cast(dict, uses[0].input)) == {"city", "days", "unit"}


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": 5}, "required": 7},
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": "x"}}, "required": ["s"]},
        {"type": "object", "properties": {"s": {"type": "string", "enum": [1, 2]}}},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": "low"}}},
        {"type": "nothing"},
    ],
)
def test_odd_tool_schemas_under_a_forced_choice_never_give_a_5xx(tiny_server: LiveServer, parameters: dict) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": "required",
        "max_tokens": 8,
    }
    reply = httpx.post(f"{tiny_server.api}/chat/completions", json=body, timeout=30)
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["message"].startswith("tools: ")
