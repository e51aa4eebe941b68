"""OpenAI's Responses API through the official openai client, against a live server over the scripted backend."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import (
    FunctionToolParam,
    Response,
    ResponseFunctionToolCall,
    ResponseInputParam,
    ResponseReasoningItem,
    ResponseStreamEvent,
)

from cmpchat.server.settings import ServerSettings
from tests.scripted_backend import EXPLODE
from tests.server.conftest import API_KEY, client_for, scripted_model
from tests.server.live import LiveServer, live_server
from tests.server.test_server_chat import CALL, last_prompt, reply_tokens

TOOLS: list[FunctionToolParam] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
        "strict": False,
    }
]


def usage_of(response: Response):
    assert response.usage is not None
    return response.usage


def test_plain_response(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    response = client.responses.create(model="m", input="SAY:Hello there")
    assert response.output_text == "Hello there"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "scripted"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    usage = usage_of(response)
    assert usage.output_tokens == reply_tokens(scripted_server, "Hello there")
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (response.model_extra or {})["timings"]["predicted_n"] == usage.output_tokens


def test_instructions_and_leading_developer_messages_make_one_system_message(
    client: openai.OpenAI, scripted_server: LiveServer
) -> None:
    client.responses.create(
        model="m",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SAY:ok"}]},
        ],
    )
    assert last_prompt(scripted_server).startswith(
        "<|im_start|>system\nBe brief.\n\nUse metric units.<|im_end|>\n<|im_start|>user\nSAY:ok<|im_end|>"
    )


def event_types(events: list[ResponseStreamEvent]) -> list[str]:
    return [event.type for event in events]


def test_streamed_response_follows_the_event_contract(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="SAY:Hello there", stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = event_types(events)
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == "Hello there"
    first, last = events[0], events[-1]
    assert first.type == "response.created" and first.response.status == "in_progress"
    assert last.type == "response.completed" and last.response.output_text == "Hello there"
    assert first.response.id == last.response.id


def test_the_clients_stream_helper_rebuilds_the_response(client: openai.OpenAI) -> None:
    # The helper checks the events against each other (item and part indices) as it accumulates them.
    with client.responses.stream(model="m", input="SAY:Hmm.</think>\n\nYes.", reasoning={"effort": "high"}) as stream:
        final = stream.get_final_response()
    reasoning, message = final.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content is not None
    assert reasoning.content[0].text == "Hmm." and final.output_text == "Yes."
    assert message.type == "message"


def test_reasoning_effort_turns_thinking_on_and_off(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    thought = client.responses.create(model="m", input="SAY:Let me think.</think>\n\n4.", reasoning={"effort": "low"})
    assert last_prompt(scripted_server).endswith("<|im_start|>assistant\n<think>\n")
    reasoning = thought.output[0]
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content is not None
    assert reasoning.content[0].text == "Let me think." and thought.output_text == "4."
    assert usage_of(thought).output_tokens_details.reasoning_tokens == len(
        scripted_server.served.tokenize("Let me think.")
    )
    for effort in ("none", "minimal"):
        plain = client.responses.create(model="m", input="SAY:Plain.", reasoning={"effort": effort})  # type: ignore[typeddict-item]
        assert last_prompt(scripted_server).endswith("<think>\n\n</think>\n\n")
        assert [item.type for item in plain.output] == ["message"] and plain.output_text == "Plain."


def test_streamed_reasoning_arrives_as_reasoning_text_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="m", input="SAY:Hmm.</think>\n\nYes.", reasoning={"effort": "medium"}, stream=True
        )
    )
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    done = [event.text for event in events if event.type == "response.reasoning_text.done"]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert (reasoning, done, text) == ("Hmm.", ["Hmm."], "Yes.")
    added = [event.output_index for event in events if event.type == "response.output_item.added"]
    assert added == [0, 1]


def test_tool_call_round_trip(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    first = client.responses.create(model="m", input="SAY:" + CALL, tools=TOOLS, tool_choice="auto")
    (call,) = first.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert first.status == "completed"

    conversation: ResponseInputParam = [
        {"role": "user", "content": "SAY:" + CALL},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "SAY:It will be sunny in Paris."},
    ]
    final = client.responses.create(model="m", input=conversation, tools=TOOLS)
    assert final.output_text == "It will be sunny in Paris."
    prompt = last_prompt(scripted_server)
    assert "<function=get_weather>" in prompt.split("<|im_start|>assistant")[1]
    assert "<tool_response>\nSAY:It will be sunny in Paris.\n</tool_response>" in prompt


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="SAY:" + CALL, tools=TOOLS, stream=True))
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, getattr(item, "name", None)) for item in added] == [("function_call", "get_weather")]
    (arguments,) = [event.arguments for event in events if event.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    last = events[-1]
    assert last.type == "response.completed"
    assert isinstance(last.response.output[0], ResponseFunctionToolCall)


def test_tool_choice_none_hides_the_tools_and_a_named_choice_offers_only_that_tool(
    client: openai.OpenAI, scripted_server: LiveServer
) -> None:
    client.responses.create(model="m", input="SAY:ok", tools=TOOLS, tool_choice="none")
    assert "get_weather" not in last_prompt(scripted_server)
    client.responses.create(
        model="m", input="SAY:ok", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}
    )
    assert "get_weather" in last_prompt(scripted_server)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.responses.create(model="m", input="SAY:ok", tools=TOOLS, tool_choice={"type": "function", "name": "g"})


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI) -> None:
    short = client.responses.create(model="m", input="SAY:abcdefgh", max_output_tokens=3, temperature=0.5, top_p=0.9)
    assert short.status == "incomplete" and short.output_text == "abc"
    assert short.incomplete_details is not None and short.incomplete_details.reason == "max_output_tokens"
    assert usage_of(short).output_tokens == 3
    events = list(client.responses.create(model="m", input="SAY:abcdefgh", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"previous_response_id": "resp_1"}, "stores no responses"),
        ({"conversation": "conv_1"}, "stores no responses"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "a JSON schema is required"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "no vision"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "text and images only"),
        ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "user messages"),
        ({"include": ["message.output_text.logprobs", "everything"]}, "include.1: 'everything' is not an includable"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input.0"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "not valid JSON"),
        ({"input": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}, "system message"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"temperature": 5}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
    ],
)
def test_bad_requests_are_400_in_openais_shape(scripted_server: LiveServer, fields: dict, fragment: str) -> None:
    body = {"model": "m", "input": "hi", **fields}
    response = httpx.post(scripted_server.api + "/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error


def test_a_failing_backend_fails_the_response(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="the device fell off the bus"):
        client.responses.create(model="m", input="SAY:" + EXPLODE)
    events = list(client.responses.create(model="m", input="SAY:" + EXPLODE, stream=True))
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error is not None and "the device fell off the bus" in last.response.error.message


def test_the_api_key_is_required(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    with live_server(ServerSettings(port=0, api_key=API_KEY), lambda: model) as server:
        assert client_for(server, api_key=API_KEY).responses.create(model="m", input="SAY:in").output_text == "in"
        with pytest.raises(openai.AuthenticationError):
            client_for(server, api_key="wrong").responses.create(model="m", input="SAY:in")
