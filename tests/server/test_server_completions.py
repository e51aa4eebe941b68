"""/v1/completions through the openai client."""

from __future__ import annotations

import openai
import pytest

from tests.server.live import LiveServer, extra


def test_completion(client: openai.OpenAI) -> None:
    result = client.completions.create(model="m", prompt="SAY:continued text", max_tokens=50)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.choices[0].text == "continued text"
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.prompt_tokens > 0 and "timings" in extra(result)


def test_completion_defaults_to_16_tokens(client: openai.OpenAI) -> None:
    result = client.completions.create(model="m", prompt="SAY:" + "x" * 40)
    assert result.choices[0].text == "x" * 16 and result.choices[0].finish_reason == "length"


def test_streamed_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="m", prompt="SAY:abc", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abc"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_token_id_prompt(client: openai.OpenAI, scripted_server: LiveServer) -> None:
    ids = scripted_server.served.tokenize("SAY:ids")
    assert client.completions.create(model="m", prompt=ids).choices[0].text == "ids"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": [999999]}, "token ids must be in"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "n": 2}, "n > 1"),
    ],
)
def test_unsupported_completion_requests(client: openai.OpenAI, fields: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="m", **fields)
