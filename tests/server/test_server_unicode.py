"""Text that is valid JSON but not valid Unicode: lone UTF-16 surrogates, as a browser sends a string cut in the
middle of an emoji. Every route reads them as U+FFFD (a surrogate pair written as two escapes is one character),
as llama-server does, instead of failing."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.scripted_backend import ScriptedBackend
from tests.server.live import LiveServer

LONE = "\\ud800"
"""A lone high surrogate as a JSON escape: `json.loads` turns it into the code point U+D800."""


def post_raw(server: LiveServer, path: str, body: str) -> httpx.Response:
    """Post `body` exactly as written, so its escapes reach the server's JSON decoder."""
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def last_prompt(server: LiveServer) -> str:
    backend = server.served.backend
    assert isinstance(backend, ScriptedBackend)
    return backend.prompts[-1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "SAY:cut ' + LONE + 'x"}]}'),
        ("/v1/completions", '{"prompt": "SAY:cut ' + LONE + 'x", "max_tokens": 8}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "SAY:cut ' + LONE + 'x"}]}]}',
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "SAY:cut"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "description": "cut ' + LONE + 'x"}}]}',
        ),
    ],
    ids=["chat", "completion", "text-part", "tool-description"],
)
def test_a_lone_surrogate_reads_as_a_replacement_character(scripted_server: LiveServer, path: str, body: str) -> None:
    response = post_raw(scripted_server, path, body)
    assert response.status_code == 200, response.text
    assert "cut \ufffdx" in last_prompt(scripted_server)


def test_a_surrogate_pair_written_as_two_escapes_is_one_character(scripted_server: LiveServer) -> None:
    body = '{"messages": [{"role": "user", "content": "SAY:smile \\ud83d\\ude00"}]}'
    response = post_raw(scripted_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "smile \U0001f600"


def test_the_python_api_tokenizes_lone_surrogates_as_replacement_characters(scripted_server: LiveServer) -> None:
    model = scripted_server.served
    assert model.tokenize("a\ud800b") == model.tokenize("a\ufffdb")
    assert model.tokenize("\udc80") == model.tokenize("\ufffd")
    assert model.tokenize("\ud83d\ude00") == model.tokenize("\U0001f600")
    assert model.tokenize("<|im_end|>\ud800", parse_special=True) == model.tokenize(
        "<|im_end|>\ufffd", parse_special=True
    )


def test_a_lone_surrogate_in_an_error_message_is_still_json(scripted_server: LiveServer) -> None:
    body = (
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],'
        ' "tool_choice": {"type": "function", "function": {"name": "' + LONE + '"}}}'
    )
    response = post_raw(scripted_server, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert "not among the tools" in json.loads(response.text)["error"]["message"]


def test_no_lone_surrogate_comes_back_in_a_response(scripted_server: LiveServer) -> None:
    body = '{"messages": [{"role": "user", "content": "cut ' + LONE + 'x"}]}'
    response = post_raw(scripted_server, "/apply-template", body)
    assert response.status_code == 200, response.text
    assert "cut \ufffdx" in response.json()["prompt"]
