"""cmpchat: Qwen3.5 / Qwen3.6 inference and chat for NVIDIA CMP 100-210 mining GPUs.

The public API is `open_model` and what it returns; see README.md ("Python API").
"""

from cmpchat.api import Model, open_model
from cmpchat.chat.messages import ImagePart, Message, TextPart, ToolCall
from cmpchat.engine.events import (
    ContentDelta,
    DecodeProgress,
    Finished,
    PromptProgress,
    ReasoningDelta,
    Timings,
    ToolCallEvent,
)
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "CmpchatError",
    "ContentDelta",
    "DecodeProgress",
    "Finished",
    "GenerationOptions",
    "ImagePart",
    "Message",
    "Model",
    "PromptProgress",
    "ReasoningDelta",
    "SamplingParams",
    "TextPart",
    "Timings",
    "ToolCall",
    "ToolCallEvent",
    "open_model",
]
