"""Typed chat messages: what front ends build and `ChatFormat` renders.

The shapes follow the OpenAI chat API so the server can map requests one to one: a message has a role,
text or a list of parts (text and images), and for assistant turns optional reasoning and tool calls.
A tool definition stays a plain OpenAI-style dict, because that is what chat templates iterate over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, get_args

from cmpchat.errors import CmpchatError

Role: TypeAlias = Literal["system", "user", "assistant", "tool"]

Tool: TypeAlias = dict[str, Any]
"""A tool schema: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

_ROLES: frozenset[str] = frozenset(get_args(Role))


@dataclass(frozen=True, slots=True)
class TextPart:
    """A run of text inside a message."""

    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image inside a message: by reference (an opaque id or a file path), or its file's bytes in `data`
    (an upload, a data URI), which the encoder then reads instead of `ref`."""

    ref: str
    data: bytes | None = None


ContentPart: TypeAlias = TextPart | ImagePart


@dataclass(slots=True)
class ToolCall:
    """One function call the assistant made: the function's name and its arguments as JSON values."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(slots=True)
class Message:
    """One turn of a conversation.

    `reasoning_content` and `tool_calls` belong to assistant turns; `tool_call_id` and `name` to tool
    results (role "tool"), naming the call they answer and the function that produced them.
    """

    role: Role
    content: str | list[ContentPart] = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise CmpchatError(f"unknown message role {self.role!r}; use one of {sorted(_ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise CmpchatError(f"a {self.role} message cannot carry tool calls; only assistant messages can")
        if not isinstance(self.content, str):
            for part in self.content:
                if not isinstance(part, TextPart | ImagePart):
                    raise CmpchatError(f"message content part {part!r} is neither text nor an image")

    @property
    def text(self) -> str:
        """The message's text with image parts left out."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def images(self) -> list[ImagePart]:
        """The message's image parts, in order."""
        if isinstance(self.content, str):
            return []
        return [part for part in self.content if isinstance(part, ImagePart)]
