"""Our built-in ChatML template: golden renderings of whole conversations."""

from __future__ import annotations

import pytest

from cmpchat.chat import ChatFormat, ImagePart, Message, TextPart, ToolCall
from cmpchat.chat.template import builtin_template, ends_in_reasoning
from cmpchat.errors import CmpchatError

NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINK = "<|im_start|>assistant\n<think>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

TOOLS_SYSTEM_TURN = (
    "<|im_start|>system\n"
    "You are terse.\n\n"
    "# Tools\n\n"
    "These functions are available to you, each described by a JSON schema:\n\n"
    "<tools>\n"
    '{"name": "get_weather", "description": "Current weather in a city, in °C", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}\n'
    "</tools>\n\n"
    "To call a function, answer with a block of this form, one <parameter> per argument, "
    "and write nothing after it:\n\n"
    "<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>\n\n"
    "Write string values as they are and every other value as JSON. "
    "For several calls, put one block after another.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat()


def test_template_is_package_data() -> None:
    assert "<|im_start|>" in builtin_template()
    assert ChatFormat().is_builtin and not ChatFormat("x").is_builtin


def test_system_and_user_default_is_not_thinking(chat: ChatFormat) -> None:
    rendered = chat.render([Message("system", "You are terse."), Message("user", "Hi")])
    assert rendered.text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + NO_THINK
    )
    assert rendered.thinking is False


def test_thinking_on(chat: ChatFormat) -> None:
    rendered = chat.render([Message("user", "Hi")], enable_thinking=True)
    assert rendered.text == "<|im_start|>user\nHi<|im_end|>\n" + THINK
    assert rendered.thinking is True


def test_explicit_off_and_no_generation_prompt(chat: ChatFormat) -> None:
    assert chat.render([Message("user", "Hi")], enable_thinking=False).text.endswith(NO_THINK)
    rendered = chat.render([Message("user", "Hi")], add_generation_prompt=False, enable_thinking=True)
    assert rendered.text == "<|im_start|>user\nHi<|im_end|>\n"
    assert rendered.thinking is False


def test_soft_switches_are_stripped_and_win_over_argument(chat: ChatFormat) -> None:
    rendered = chat.render([Message("user", "Why is the sky blue? /think")], enable_thinking=False)
    assert rendered.text == "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n" + THINK
    assert rendered.thinking is True
    rendered = chat.render([Message("system", "/no_think Be brief."), Message("user", "Hi")], enable_thinking=True)
    assert rendered.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert rendered.thinking is False


def test_last_switch_wins_across_system_and_user(chat: ChatFormat) -> None:
    messages = [Message("system", "Be brief. /no_think"), Message("user", "/no_think Explain. /think")]
    assert chat.render(messages).thinking is True
    messages = [Message("system", "/think"), Message("user", "Explain. /no_think")]
    assert chat.render(messages).thinking is False
    # The system switch stands when the latest user message has none.
    messages = [Message("system", "/think"), Message("user", "Explain.")]
    assert chat.render(messages, enable_thinking=False).thinking is True


def test_switch_in_older_user_turn_is_stripped_but_ignored(chat: ChatFormat) -> None:
    messages = [Message("user", "First /think"), Message("assistant", "One."), Message("user", "Second")]
    rendered = chat.render(messages)
    assert rendered.text.startswith("<|im_start|>user\nFirst<|im_end|>\n")
    assert rendered.thinking is False


def test_images_in_user_content(chat: ChatFormat) -> None:
    message = Message("user", [TextPart("Compare "), ImagePart("img-1"), TextPart(" and "), ImagePart("/tmp/b.png")])
    assert chat.render([message]).text == (
        "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n" + NO_THINK
    )


def test_tools_and_a_full_tool_exchange(chat: ChatFormat) -> None:
    messages = [
        Message("system", "You are terse."),
        Message("user", "Weather in Zürich and Oslo?"),
        Message(
            "assistant",
            "Checking both.",
            reasoning_content="\nTwo cities, two calls.\n",
            tool_calls=[
                ToolCall("get_weather", {"city": "Zürich", "days": 2}, "call_1"),
                ToolCall("get_weather", {"city": "Oslo", "opts": {"units": ["C"], "raw": None}}, "call_2"),
            ],
        ),
        Message("tool", "12 °C", tool_call_id="call_1", name="get_weather"),
        Message("tool", "3 °C", tool_call_id="call_2", name="get_weather"),
    ]
    rendered = chat.render(messages, tools=[WEATHER_TOOL], enable_thinking=True)
    assert rendered.text == (
        TOOLS_SYSTEM_TURN
        + "<|im_start|>user\nWeather in Zürich and Oslo?<|im_end|>\n"
        + "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking both.\n\n"
        + "<tool_call>\n<function=get_weather>\n"
        + "<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        + "</function>\n</tool_call>\n"
        + "<tool_call>\n<function=get_weather>\n"
        + '<parameter=city>\nOslo\n</parameter>\n<parameter=opts>\n{"units": ["C"], "raw": null}\n</parameter>\n'
        + "</function>\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response>\n"
        + "<tool_response>\n3 °C\n</tool_response><|im_end|>\n"
        + THINK
    )
    assert rendered.thinking is True


def test_tools_without_system_message(chat: ChatFormat) -> None:
    text = chat.render([Message("user", "Hi")], tools=[WEATHER_TOOL]).text
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text == TOOLS_SYSTEM_TURN.replace("You are terse.\n\n", "") + "<|im_start|>user\nHi<|im_end|>\n" + NO_THINK


def test_tool_call_without_content_and_without_arguments(chat: ChatFormat) -> None:
    messages = [
        Message("user", "Time?"),
        Message("assistant", "", tool_calls=[ToolCall("now", {}, "c")]),
        Message("tool", "12:00", tool_call_id="c"),
        Message("assistant", "Noon."),
    ]
    assert chat.render(messages, add_generation_prompt=False).text == (
        "<|im_start|>user\nTime?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nNoon.<|im_end|>\n"
    )


def test_reasoning_kept_only_after_the_last_user_query(chat: ChatFormat) -> None:
    messages = [
        Message("user", "A?"),
        Message("assistant", "a", reasoning_content="old thoughts"),
        Message("user", "B?"),
        Message("assistant", "", reasoning_content="new thoughts", tool_calls=[ToolCall("f", {"x": "1"}, "c")]),
        Message("tool", "done", tool_call_id="c"),
        Message("assistant", "b", reasoning_content="more thoughts"),
    ]
    text = chat.render(messages, add_generation_prompt=False).text
    assert text == (
        "<|im_start|>user\nA?<|im_end|>\n"
        "<|im_start|>assistant\na<|im_end|>\n"
        "<|im_start|>user\nB?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\n"
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nmore thoughts\n</think>\n\nb<|im_end|>\n"
    )
    assert "old thoughts" not in text


def test_user_turn_wrapping_tool_responses_is_not_a_query(chat: ChatFormat) -> None:
    messages = [
        Message("user", "Q"),
        Message("assistant", "", reasoning_content="r1", tool_calls=[ToolCall("f", {}, "c")]),
        Message("user", "<tool_response>\nok\n</tool_response>"),
    ]
    assert "<think>\nr1\n</think>" in chat.render(messages).text


def test_reasoning_inline_in_content_is_split(chat: ChatFormat) -> None:
    messages = [Message("user", "Q"), Message("assistant", "<think>\nhm\n</think>\n\nAnswer")]
    assert chat.render(messages, add_generation_prompt=False).text.endswith(
        "<|im_start|>assistant\n<think>\nhm\n</think>\n\nAnswer<|im_end|>\n"
    )


def test_system_message_must_come_first(chat: ChatFormat) -> None:
    with pytest.raises(CmpchatError, match="refused the conversation: a system message may only come first"):
        chat.render([Message("user", "Hi"), Message("system", "late")])


@pytest.mark.parametrize(
    ("text", "thinking"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n<think>\nhalf a thought", True),
        ("<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>\n", False),
        ("<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n", False),
        ("no chatml at all <think>", True),
        ("", False),
    ],
)
def test_ends_in_reasoning(text: str, thinking: bool) -> None:
    assert ends_in_reasoning(text) is thinking
