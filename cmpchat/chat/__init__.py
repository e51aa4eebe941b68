"""The chat format layer: typed messages, prompt rendering through the model's chat template, and
parsing of generated text into reasoning, answer text and tool calls."""

from cmpchat.chat.messages import ContentPart, ImagePart, Message, Role, TextPart, Tool, ToolCall
from cmpchat.chat.output_parser import ContentDelta, Event, OutputParser, ReasoningDelta, ToolCallEvent
from cmpchat.chat.template import ChatFormat, RenderedPrompt

__all__ = [
    "ChatFormat",
    "ContentDelta",
    "ContentPart",
    "Event",
    "ImagePart",
    "Message",
    "OutputParser",
    "ReasoningDelta",
    "RenderedPrompt",
    "Role",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolCallEvent",
]
