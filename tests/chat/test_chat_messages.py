"""Message dataclasses: validation and convenience accessors."""

from __future__ import annotations

import pytest

from cmpchat.chat import ImagePart, Message, TextPart, ToolCall
from cmpchat.errors import CmpchatError


def test_text_and_images() -> None:
    message = Message("user", [TextPart("a"), ImagePart("img"), TextPart("b")])
    assert message.text == "ab"
    assert message.images == [ImagePart("img")]
    assert Message("user", "plain").images == []


def test_defaults() -> None:
    message = Message("assistant")
    assert (message.content, message.reasoning_content, message.tool_calls) == ("", None, [])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"role": "robot"}, "unknown message role 'robot'"),
        ({"role": "user", "tool_calls": [ToolCall("f", {}, "c")]}, "a user message cannot carry tool calls"),
        ({"role": "user", "content": ["text"]}, "neither text nor an image"),
    ],
)
def test_invalid_messages(kwargs: dict, error: str) -> None:
    with pytest.raises(CmpchatError, match=error):
        Message(**kwargs)
