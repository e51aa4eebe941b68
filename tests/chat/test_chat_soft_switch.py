"""`/think` and `/no_think`: taken out of the text, turned into the thinking flag."""

from __future__ import annotations

import pytest

from cmpchat.chat import ImagePart, Message, TextPart
from cmpchat.chat.soft_switch import apply_switches, strip_switches


@pytest.mark.parametrize(
    ("text", "cleaned", "switch"),
    [
        ("Hello", "Hello", None),
        ("Hello /think", "Hello", True),
        ("/no_think Hello", "Hello", False),
        ("a /think b", "a b", True),
        ("a\t/no_think\tb", "a b", False),
        ("/think /no_think go", "go", False),
        ("line one /think\nline two", "line one\nline two", True),
        ("line one\n  /no_think  \nline two", "line one\n\nline two", False),
        ("x\n/think y", "x\ny", True),
        ("see /think/notes.md or a/think", "see /think/notes.md or a/think", None),
        ("/thinking is not a switch", "/thinking is not a switch", None),
        ("  padded  ", "  padded  ", None),
        ("/think", "", True),
    ],
)
def test_strip_switches(text: str, cleaned: str, switch: bool | None) -> None:
    assert strip_switches(text) == (cleaned, switch)


def test_apply_switches_reads_system_and_last_user_only() -> None:
    messages = [
        Message("system", "Sys /think"),
        Message("user", "old /no_think"),
        Message("assistant", "reply /no_think"),
        Message("user", "new"),
    ]
    cleaned, switch = apply_switches(messages)
    assert switch is True
    assert [m.text for m in cleaned] == ["Sys", "old", "reply /no_think", "new"]
    assert messages[0].content == "Sys /think"  # the caller's messages are not modified


def test_apply_switches_in_text_parts() -> None:
    messages = [Message("user", [TextPart("What is it? "), ImagePart("i"), TextPart(" /no_think")])]
    cleaned, switch = apply_switches(messages)
    assert switch is False
    assert cleaned[0].content == [TextPart("What is it? "), ImagePart("i"), TextPart("")]
