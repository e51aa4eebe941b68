"""Malformed and random requests over every route, their text full of odd Unicode (lone surrogates, noncharacters,
controls, combining marks, special-token text): every answer is a well-formed response or a 4xx error object (in
Anthropic's shape on its routes), the server never answers 5xx and keeps serving. About 1650 requests, a few
seconds."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.live import LiveServer

ODD_PIECES = (
    "\ud800",  # lone surrogates: a string cut in the middle of an emoji
    "\udfff",
    "\ud83d",
    "\ude00\ud83d",  # a pair in the wrong order
    "\x00",
    "\x1b[31m",
    "\ufeff",
    "\ufffe",
    "\uffff",
    "\U0010ffff",
    "\u202e",
    "\u2028",
    "\r\n",
    "e\u0301",
    ">\u0338",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<function=f>",
    "SAY:",
)
odd_text = st.lists(
    st.sampled_from(ODD_PIECES)
    | st.characters(categories=["Cs"])
    | st.text(st.characters(exclude_categories=()), max_size=6),
    max_size=6,
).map("".join)
"""Text as clients really send it, and worse: every code point a JSON string can carry."""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | odd_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(odd_text, children, max_size=4),
    max_leaves=16,
)

roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER"])
parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
        optional={"text": odd_text | json_values, "image_url": json_values},
    ),
    max_size=3,
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({"name": odd_text}, optional={"arguments": odd_text | json_values})},
        optional={"id": odd_text, "type": st.just("function")},
    ),
    max_size=2,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": odd_text | parts | json_values,
            "tool_calls": tool_calls | json_values,
            "tool_call_id": odd_text | json_values,
            "name": odd_text | json_values,
            "reasoning_content": odd_text,
        },
    ),
    max_size=4,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": odd_text},
                optional={"description": odd_text, "parameters": st.dictionaries(odd_text, json_values, max_size=3)},
            ),
        }
    ),
    max_size=3,
)
numbers = st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | json_values
limits = st.integers(1, 4)
stops = st.lists(odd_text, max_size=3)

# Each route gets bodies of two kinds: well-formed ones with odd text wherever text goes, which reach the template,
# the tokenizer and the engine, and ones where any field may be anything, which mostly test validation.
well_formed_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": odd_text}),
    min_size=1,
    max_size=3,
)
well_formed_extras = {
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
}
any_conversation = {
    "messages": messages | json_values,
    "tools": tools | json_values,
    "tool_choice": json_values,
    "chat_template_kwargs": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": well_formed_messages, "max_tokens": limits},
    optional={**well_formed_extras, "stream": st.booleans(), "stop": stops},
) | st.fixed_dictionaries(
    {"max_tokens": limits | json_values},
    optional={
        **any_conversation,
        "model": odd_text | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "min_p": numbers,
        "seed": numbers,
        "stop": odd_text | st.lists(odd_text, max_size=20) | json_values,
        "presence_penalty": numbers,
        "frequency_penalty": numbers,
        "n": numbers,
    },
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": odd_text, "max_tokens": limits}, optional={"stream": st.booleans(), "stop": stops}
) | st.fixed_dictionaries(
    {"max_tokens": limits | json_values},
    optional={
        "prompt": odd_text | st.lists(st.integers(-3, 300), max_size=8) | json_values,
        "stream": st.booleans() | json_values,
        "temperature": numbers,
        "stop": odd_text | json_values,
        "echo": json_values,
    },
)
tokenize_bodies = st.fixed_dictionaries(
    {"content": odd_text}, optional={"parse_special": st.booleans(), "with_pieces": st.booleans()}
) | st.fixed_dictionaries(
    {},
    optional={
        "content": odd_text | json_values,
        "parse_special": json_values,
        "with_pieces": json_values,
        "add_special": json_values,
    },
)
detokenize_bodies = st.fixed_dictionaries(
    {}, optional={"tokens": st.lists(st.integers(0, 300)) | st.lists(st.integers(-3, 2**40), max_size=12) | json_values}
)
template_bodies = st.fixed_dictionaries(
    {"messages": well_formed_messages}, optional=well_formed_extras
) | st.fixed_dictionaries({}, optional=any_conversation)

response_items = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": odd_text | parts}
    )
    | st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": odd_text, "name": odd_text, "arguments": odd_text}
    )
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": odd_text, "output": odd_text})
    | st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={"content": st.lists(st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": odd_text}))},
    ),
    min_size=1,
    max_size=4,
)
response_tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "name": odd_text},
        optional={"description": odd_text, "parameters": st.dictionaries(odd_text, json_values, max_size=3)},
    ),
    max_size=3,
)
response_bodies = st.fixed_dictionaries(
    {"input": odd_text | response_items, "max_output_tokens": limits},
    optional={
        "instructions": odd_text,
        "stream": st.booleans(),
        "tools": response_tools,
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "minimal", "low", "high"])}),
    },
) | st.fixed_dictionaries(
    {"max_output_tokens": limits | json_values},
    optional={
        "input": response_items | json_values,
        "instructions": json_values,
        "stream": st.booleans() | json_values,
        "tools": response_tools | json_values,
        "tool_choice": json_values,
        "reasoning": json_values,
        "text": json_values,
        "temperature": numbers,
        "top_p": numbers,
        "previous_response_id": json_values,
    },
)
message_blocks = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": odd_text})
    | st.fixed_dictionaries({"type": st.just("thinking"), "thinking": odd_text})
    | st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": odd_text, "name": odd_text, "input": st.dictionaries(odd_text, json_values)}
    )
    | st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": odd_text},
        optional={"content": odd_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}))},
    ),
    max_size=3,
)
anthropic_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": odd_text | message_blocks}),
    min_size=1,
    max_size=3,
)
anthropic_tools = st.lists(
    st.fixed_dictionaries(
        {"name": odd_text, "input_schema": st.dictionaries(odd_text, json_values, max_size=3)},
        optional={"description": odd_text},
    ),
    max_size=3,
)
anthropic_conversation = {
    "system": odd_text,
    "tools": anthropic_tools,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])}),
}
message_bodies = st.fixed_dictionaries(
    {"messages": anthropic_messages, "max_tokens": limits},
    optional={**anthropic_conversation, "stream": st.booleans(), "stop_sequences": stops},
) | st.fixed_dictionaries(
    {"max_tokens": limits | json_values},
    optional={
        "messages": anthropic_messages | messages | json_values,
        "system": json_values,
        "tools": anthropic_tools | json_values,
        "tool_choice": json_values,
        "thinking": json_values,
        "stream": st.booleans() | json_values,
        "stop_sequences": json_values,
        "temperature": numbers,
        "top_k": numbers,
    },
)
count_tokens_bodies = st.fixed_dictionaries({"messages": anthropic_messages}, optional=anthropic_conversation)

ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
ROUTES = (
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/v1/models",
    "/models",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/props",
    "/slots",
    "/slots?fail_on_no_slot=1",
    "/health",
    "/v1/health",
    "/metrics",
    "/v1/cmpchat/gpus",
    "/v1/responses",
    "/responses",
    *ANTHROPIC_ROUTES,
)


def check(response: httpx.Response) -> None:
    """A generation route's answer: a full response, or a client error."""
    assert response.status_code in (200, 400, 413), (response.status_code, response.text)
    if response.status_code != 200:
        check_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def check_response(response: httpx.Response) -> None:
    """A Responses API answer: a response that completed, or a client error."""
    assert response.status_code in (200, 400, 413), (response.status_code, response.text)
    if response.status_code != 200:
        check_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        # Split on line feeds alone, as server-sent events are: splitlines() also splits at U+2028 inside the JSON.
        events = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: ")]
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    else:
        assert response.json()["status"] in ("completed", "incomplete")


def check_message(response: httpx.Response) -> None:
    """A Messages API answer: a whole message, or a client error in Anthropic's shape."""
    assert response.status_code in (200, 400, 413), (response.status_code, response.text)
    if response.status_code != 200:
        check_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in response.text.split("\n") if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop" and "error" not in names, names
    else:
        assert response.json()["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")


def check_error(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str)
    if response.request.url.path in ANTHROPIC_ROUTES:
        assert body["type"] == "error" and error["type"] in ("invalid_request_error", "request_too_large"), body
    else:
        assert error["type"] == "invalid_request_error"


def check_any(response: httpx.Response) -> None:
    """Any route's answer: never a server error, and JSON unless it is a stream or the metrics page."""
    if response.status_code != 200:
        check_error(response)
    elif response.request.url.path.endswith("completions"):
        check(response)
    elif response.request.url.path.endswith("responses"):
        check_response(response)
    elif response.request.url.path == "/v1/messages":
        check_message(response)
    elif response.request.url.path != "/metrics":
        response.json()


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes infinities as Infinity, which is not JSON: the server must refuse it cleanly.
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def http(scripted_server: LiveServer):
    with httpx.Client(base_url=scripted_server.url, timeout=30) as client:
        yield client


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz(300)
@given(body=chat_bodies)
def test_fuzzed_chat_requests(http: httpx.Client, body: dict) -> None:
    check(post_json(http, "/v1/chat/completions", body))


@fuzz(200)
@given(body=completion_bodies)
def test_fuzzed_completion_requests(http: httpx.Client, body: dict) -> None:
    check(post_json(http, "/v1/completions", body))


@fuzz(150)
@given(body=tokenize_bodies)
def test_fuzzed_tokenize_requests(http: httpx.Client, body: dict) -> None:
    response = post_json(http, "/tokenize", body)
    if response.status_code == 200:
        assert isinstance(response.json()["tokens"], list)
    else:
        check_error(response)


@fuzz(100)
@given(body=detokenize_bodies)
def test_fuzzed_detokenize_requests(http: httpx.Client, body: dict) -> None:
    response = post_json(http, "/detokenize", body)
    if response.status_code == 200:
        assert isinstance(response.json()["content"], str)
    else:
        check_error(response)


@fuzz(150)
@given(body=template_bodies)
def test_fuzzed_apply_template_requests(http: httpx.Client, body: dict) -> None:
    response = post_json(http, "/apply-template", body)
    if response.status_code == 200:
        assert isinstance(response.json()["prompt"], str)
    else:
        check_error(response)


@fuzz(150)
@given(body=response_bodies)
def test_fuzzed_responses_requests(http: httpx.Client, body: dict) -> None:
    check_response(post_json(http, "/v1/responses", body))


@fuzz(150)
@given(body=message_bodies)
def test_fuzzed_messages_requests(http: httpx.Client, body: dict) -> None:
    check_message(post_json(http, "/v1/messages", body))


@fuzz(50)
@given(body=count_tokens_bodies | message_bodies)
def test_fuzzed_count_tokens_requests(http: httpx.Client, body: dict) -> None:
    response = post_json(http, "/v1/messages/count_tokens", body)
    if response.status_code == 200:
        assert response.json()["input_tokens"] > 0
    else:
        check_error(response)


@fuzz(300)
@given(
    route=st.sampled_from(ROUTES),
    method=st.sampled_from(["GET", "POST", "PUT"]),
    body=json_values | chat_bodies | completion_bodies | tokenize_bodies | response_bodies | message_bodies,
)
def test_any_body_on_any_route(http: httpx.Client, route: str, method: str, body: object) -> None:
    content = json.dumps(body) if method != "GET" else None
    check_any(http.request(method, route, content=content, headers={"content-type": "application/json"}))


@fuzz(100)
@given(raw=st.binary(max_size=300), route=st.sampled_from([r for r in ROUTES if "health" not in r]))
def test_random_bytes(http: httpx.Client, raw: bytes, route: str) -> None:
    check_any(http.post(route, content=raw, headers={"content-type": "application/json"}))


def test_server_survives_the_fuzzing(http: httpx.Client, scripted_server: LiveServer) -> None:
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "SAY:still here"}]})
    assert reply.json()["choices"][0]["message"]["content"] == "still here"
