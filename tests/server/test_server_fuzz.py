"""Malformed and random requests: every answer is a well-formed response or a 4xx error object, the
server never answers 500 and keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.live import LiveServer

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=16,
)

roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER"])
parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
        optional={"text": json_values, "image_url": json_values},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": st.text(max_size=40) | parts | json_values,
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },
    ),
    max_size=4,
)
numbers = st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | json_values
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": messages | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "max_tokens": st.integers(-2, 64) | json_values,
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "min_p": numbers,
        "seed": numbers,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "chat_template_kwargs": json_values,
        "presence_penalty": numbers,
        "frequency_penalty": numbers,
        "n": numbers,
    },
)
completion_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 300), max_size=8) | json_values,
        "max_tokens": st.integers(-2, 32) | json_values,
        "stream": st.booleans(),
        "temperature": numbers,
        "echo": json_values,
    },
)


def check(response: httpx.Response) -> None:
    assert response.status_code in (200, 400, 413), (response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes infinities as Infinity, which is not JSON: the server must refuse it cleanly.
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def http(scripted_server: LiveServer):
    with httpx.Client(base_url=scripted_server.api, timeout=30) as client:
        yield client


FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_requests(http: httpx.Client, body: dict) -> None:
    check(post_json(http, "/chat/completions", body))


@FUZZ
@given(body=completion_bodies)
def test_fuzzed_completion_requests(http: httpx.Client, body: dict) -> None:
    check(post_json(http, "/completions", body))


@settings(max_examples=60, deadline=None, database=None)
@given(raw=st.binary(max_size=300), path=st.sampled_from(["/chat/completions", "/completions"]))
def test_random_bytes(http: httpx.Client, raw: bytes, path: str) -> None:
    check(http.post(path, content=raw, headers={"content-type": "application/json"}))


def test_server_survives_the_fuzzing(http: httpx.Client, scripted_server: LiveServer) -> None:
    assert httpx.get(scripted_server.url + "/health").status_code == 200
    reply = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "SAY:still here"}]})
    assert reply.json()["choices"][0]["message"]["content"] == "still here"
