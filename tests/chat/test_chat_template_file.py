"""A model file's own template is honoured, and any template runs inside the sandbox."""

from __future__ import annotations

import pytest

from cmpchat.chat import ChatFormat, ImagePart, Message, TextPart, ToolCall
from cmpchat.errors import CmpchatError

# A small template in the manner of Qwen3.5's (written for this test): thinking on unless disabled,
# images as HF parts, reasoning_content, tool calls with dict arguments, tool results as role "tool".
# Its turns say "<|im_start|>model" so its output cannot be mistaken for ours.
FILE_TEMPLATE = """\
{%- macro body(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for item in content -%}
{%- if item.type == 'image' -%}<IMG>{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools %}[tools {{ tools | map(attribute='function.name') | join(',') }}]{{ tools[0] | tojson }}
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_start|>model
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif -%}
{{ body(m.content) }}
{%- for tc in m.tool_calls if m.tool_calls is defined -%}
<call {{ tc.function.name }}{% for k, v in tc.function.arguments | items %} {{ k }}={{ v | tojson }}{% endfor %}>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>tool {{ m.tool_call_id }}
{{ body(m.content) }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ body(m.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>model
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}
"""


def test_file_template_is_used_with_its_own_default() -> None:
    chat = ChatFormat.from_metadata({"tokenizer.chat_template": FILE_TEMPLATE, "general.name": "x"})
    rendered = chat.render([Message("user", "Hi")])
    assert rendered.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>model\n<think>\n"
    assert rendered.thinking is True
    rendered = chat.render([Message("user", "Hi")], enable_thinking=False)
    assert rendered.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>model\n<think>\n\n</think>\n\n"
    assert rendered.thinking is False


def test_soft_switch_applies_to_file_template() -> None:
    rendered = ChatFormat(FILE_TEMPLATE).render([Message("user", "Hi /no_think")])
    assert rendered.text.startswith("<|im_start|>user\nHi<|im_end|>\n")
    assert rendered.thinking is False


def test_file_template_gets_hf_shaped_messages() -> None:
    messages = [
        Message("user", [TextPart("Look: "), ImagePart("img-7")]),
        Message(
            "assistant",
            "",
            reasoning_content="need a tool",
            tool_calls=[ToolCall("zoom", {"factor": 2, "where": "top ü"}, "call_9")],
        ),
        Message("tool", "zoomed", tool_call_id="call_9", name="zoom"),
    ]
    tools = [{"type": "function", "function": {"name": "zoom", "description": "Zoom <in>", "parameters": {}}}]
    text = ChatFormat(FILE_TEMPLATE).render(messages, tools=tools, add_generation_prompt=False).text
    assert text == (
        '[tools zoom]{"type": "function", "function": {"name": "zoom", "description": "Zoom <in>", "parameters": {}}}\n'
        "<|im_start|>user\nLook: <IMG><|im_end|>\n"
        '<|im_start|>model\n<think>need a tool</think><call zoom factor=2 where="top ü"><|im_end|>\n'
        "<|im_start|>tool call_9\nzoomed<|im_end|>\n"
    )


def test_text_only_parts_reach_templates_as_a_string() -> None:
    text = ChatFormat("{{ messages[0].content is string }}").render([Message("user", [TextPart("a"), TextPart("b")])])
    assert text.text == "True"


@pytest.mark.parametrize("metadata", [{}, {"tokenizer.chat_template": ""}])
def test_missing_template_falls_back_to_ours(metadata: dict[str, str]) -> None:
    assert ChatFormat.from_metadata(metadata).is_builtin


def test_non_text_template_in_metadata() -> None:
    with pytest.raises(CmpchatError, match=r"tokenizer\.chat_template in the model file is a int"):
        ChatFormat.from_metadata({"tokenizer.chat_template": 3})


def test_syntax_error_is_one_line() -> None:
    with pytest.raises(CmpchatError, match=r"^chat template has a syntax error at line 2: ") as info:
        ChatFormat("ok\n{% if %}\n")
    assert "\n" not in str(info.value)


def test_raise_exception() -> None:
    with pytest.raises(CmpchatError, match=r"^chat template refused the conversation: no tools\s*here$"):
        ChatFormat("{{ raise_exception('no tools\\n here') }}").render([Message("user", "x")])


def test_helpers_hf_templates_use() -> None:
    template = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatFormat(template).render([Message("user", "a"), Message("user", "b")]).text == "a"
    assert ChatFormat("{{ {'k': 'é<&>'} | tojson }}").render([]).text == '{"k": "é<&>"}'
    assert ChatFormat("{{ 'x' | tojson(indent=2) }}").render([]).text == '"x"'
    assert len(ChatFormat("{{ strftime_now('%Y-%m-%d') }}").render([]).text) == 10
    assert ChatFormat("A\n  {% if true %}\nB\n  {% endif %}\nC").render([]).text == "A\nB\nC"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages[0]['__class__'] }}",
        "{% set l = [] %}{{ l.append(1) }}",
        "{{ 'x' * 100000000 }}",
        "{{ 10 ** 100000 }}",
    ],
)
def test_sandbox_violations(template: str) -> None:
    with pytest.raises(CmpchatError, match=r"^chat template tried a forbidden operation: "):
        ChatFormat(template).render([Message("user", "x")])


def test_other_runtime_errors_are_wrapped() -> None:
    with pytest.raises(CmpchatError, match=r"^chat template failed: "):
        ChatFormat("{{ nothing.here }}").render([])
    with pytest.raises(CmpchatError, match=r"^chat template failed: "):
        ChatFormat("{{ 1 / 0 }}").render([])
