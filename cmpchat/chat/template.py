"""`ChatFormat`: turns a conversation into the prompt text a model expects, via its Jinja chat template.

The model file's own template (`tokenizer.chat_template`) is used when it has one, our ChatML template
(`chatml.jinja`) otherwise. Messages reach the template in the Hugging Face / OpenAI dict form that
model templates are written against.

Thinking is decided in this order, first that applies wins:
1. a `/think` or `/no_think` typed in the last user message or the system message (the last one wins),
2. the `enable_thinking` argument (the caller's default, e.g. the app setting or an API field),
3. the template's own default (ours: off; Qwen3.5 files: usually on, depending on the model size).
Whether the prompt really ends inside a reasoning block is then read from the rendered text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from cmpchat.chat.messages import ImagePart, Message, TextPart, Tool
from cmpchat.chat.sandbox import compile_template, render_template
from cmpchat.chat.soft_switch import apply_switches
from cmpchat.chat.tags import THINK_CLOSE, THINK_OPEN, TURN_END
from cmpchat.errors import CmpchatError

_METADATA_KEY = "tokenizer.chat_template"


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A rendered prompt; `thinking` is True when it ends inside an open `<think>` block."""

    text: str
    thinking: bool


def builtin_template() -> str:
    """The source of our ChatML template, read from the installed package."""
    return resources.files("cmpchat.chat").joinpath("chatml.jinja").read_text(encoding="utf-8")


class ChatFormat:
    """A compiled chat template and the rules around it (soft switches, thinking detection)."""

    def __init__(self, template: str | None = None) -> None:
        """Compile `template` (Jinja source); None selects our built-in ChatML template."""
        self.is_builtin = template is None
        self.source = builtin_template() if template is None else template
        self._template = compile_template(self.source)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ChatFormat:
        """The chat format of a model file: its `tokenizer.chat_template`, or ours if it has none."""
        template = metadata.get(_METADATA_KEY)
        if template is not None and not isinstance(template, str):
            raise CmpchatError(f"{_METADATA_KEY} in the model file is a {type(template).__name__}, not text")
        return cls(template or None)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> RenderedPrompt:
        """Render `messages` (and `tools`, if any) to prompt text.

        `enable_thinking=None` leaves the choice to the template; a soft switch in the messages
        overrides the argument (see the module docstring).
        """
        messages, switch = apply_switches(messages)
        if switch is not None:
            enable_thinking = switch
        variables: dict[str, Any] = {
            "messages": [_template_message(m) for m in messages],
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
        }
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        text = render_template(self._template, variables)
        return RenderedPrompt(text=text, thinking=ends_in_reasoning(text))


def ends_in_reasoning(text: str) -> bool:
    """Whether generation after `text` starts inside a reasoning block.

    Looks at what follows the last finished turn (`<|im_end|>`), i.e. the generation prompt or a
    partial assistant turn: it is inside reasoning when its last `<think>` has no `</think>` after it.
    """
    tail = text[text.rfind(TURN_END) + len(TURN_END) :] if TURN_END in text else text
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def _template_message(message: Message) -> dict[str, Any]:
    """One message in the dict form chat templates read."""
    result: dict[str, Any] = {"role": message.role, "content": _template_content(message.content)}
    if message.reasoning_content is not None:
        result["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        result["name"] = message.name
    return result


def _template_content(content: str | list[TextPart | ImagePart]) -> str | list[dict[str, str]]:
    # Text-only part lists become one string: templates written for plain strings then work too.
    if isinstance(content, str):
        return content
    if all(isinstance(part, TextPart) for part in content):
        return "".join(part.text for part in content if isinstance(part, TextPart))
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"} for part in content
    ]
