"""Every mistake a client can make gets a 4xx with an OpenAI-style error object, and the server lives on."""

from __future__ import annotations

import http.client
import json
import logging
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai.types.chat import (
    ChatCompletionContentPartImageParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from cmpchat.server.settings import ServerSettings
from tests.scripted_backend import EXPLODE
from tests.server.conftest import scripted_model
from tests.server.live import LiveServer, live_server


def post(server: LiveServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.api + path, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, fragment: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert fragment in error["message"]
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "body is empty"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "not a JSON number"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[" * 50_000, "not valid JSON"),
    ],
    ids=["broken", "empty", "array", "nan", "binary", "deep"],
)
def test_malformed_bodies(scripted_server: LiveServer, body: bytes, fragment: str) -> None:
    error = assert_error(post(scripted_server, "/chat/completions", content=body), 400, fragment)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": -7}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"chat_template_kwargs": {"enable_thinking": "maybe"}}, "chat_template_kwargs"),
        ({"n": 3}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_parameters(scripted_server: LiveServer, fields: dict, param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    error = assert_error(post(scripted_server, "/chat/completions", json=body), 400, "")
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0])


def test_image_part_is_refused_clearly(client: openai.OpenAI) -> None:
    image: ChatCompletionContentPartImageParam = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
    }
    with pytest.raises(openai.BadRequestError, match="no vision projector") as caught:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
        )
    assert caught.value.code == "image_input_not_supported"


def test_template_errors_are_400(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "late"},
    ]
    with pytest.raises(openai.BadRequestError, match="system message"):
        client.chat.completions.create(model="m", messages=messages)


def test_bad_tool_call_arguments(client: openai.OpenAI) -> None:
    call: ChatCompletionMessageFunctionToolCallParam = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": "{broken"},
    }
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(model="m", messages=messages)


def test_unknown_named_tool(client: openai.OpenAI) -> None:
    tools: list[ChatCompletionToolParam] = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "g"}},
        )


def test_prompt_longer_than_the_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="context") as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "z" * 5000}])
    assert caught.value.code == "context_length_exceeded"


def test_body_over_the_limit_is_413(scripted_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_error(post(scripted_server, "/chat/completions", json=body), 413, "larger than")


def test_unknown_route_and_method(scripted_server: LiveServer) -> None:
    assert_error(httpx.get(scripted_server.api + "/nothing"), 404, "no route")
    assert_error(httpx.get(scripted_server.api + "/chat/completions"), 405, "not allowed")


def test_a_failing_backend_gives_500_not_a_dead_server(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "SAY:" + EXPLODE}]
    with pytest.raises(openai.InternalServerError, match="the device fell off the bus") as caught:
        client.chat.completions.create(model="m", messages=messages)
    assert "Traceback" not in str(caught.value.body)
    with pytest.raises(openai.APIError, match="the device fell off the bus"):
        list(client.chat.completions.create(model="m", messages=messages, stream=True))


def test_server_still_answers(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "SAY:alive"}])
    assert reply.choices[0].message.content == "alive"


def test_an_unexpected_error_is_a_json_500_on_a_connection_that_stays_usable(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = scripted_model(tiny_model_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in preparation")

    monkeypatch.setattr(model, "chat_request", broken)
    headers = {"content-type": "application/json"}
    with live_server(ServerSettings(port=0), lambda: model) as server:
        address = urlsplit(server.url)
        assert address.hostname is not None and address.port is not None
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        chat = json.dumps({"messages": [{"role": "user", "content": "x"}]})
        for _ in range(3):  # one keep-alive connection throughout: a reset would raise here
            connection.request("POST", "/v1/chat/completions", body=chat, headers=headers)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 500 and error["type"] == "server_error"
            assert "RuntimeError" in error["message"] and "a bug" not in error["message"]
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "SAY:fine"}), headers=headers)
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"][0]["text"] == "fine"
        connection.close()
    logged = [record for record in caplog.records if record.levelno == logging.ERROR and record.exc_info]
    assert len(logged) == 3 and "RuntimeError: a bug in preparation" in caplog.text  # with its traceback
