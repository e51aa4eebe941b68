"""The streaming output parser: same events whatever the delta boundaries, nothing lost, nothing late."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmpchat.chat import ContentDelta, Event, OutputParser, ReasoningDelta, ToolCall, ToolCallEvent


def make_parser(starts_in_reasoning: bool, tools: Sequence[dict] | None = None) -> OutputParser:
    ids = itertools.count()
    return OutputParser(starts_in_reasoning, tools=tools, id_factory=lambda: f"call_{next(ids)}")


def merged(events: Sequence[Event]) -> list[Event]:
    """Join neighbouring deltas of one kind: how text is cut into deltas may vary, the text may not."""
    result: list[Event] = []
    for event in events:
        if result and isinstance(event, ReasoningDelta | ContentDelta) and type(result[-1]) is type(event):
            result[-1] = type(event)(result[-1].text + event.text)  # type: ignore[union-attr]
        else:
            result.append(event)
    return result


def parse(chunks: Sequence[str], starts_in_reasoning: bool, tools: Sequence[dict] | None = None) -> list[Event]:
    parser = make_parser(starts_in_reasoning, tools)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def call(name: str, arguments: dict, index: int = 0) -> ToolCallEvent:
    return ToolCallEvent(ToolCall(name=name, arguments=arguments, id=f"call_{index}"))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
]

# (generated text, starts in reasoning, expected events)
SAMPLES: list[tuple[str, bool, list[Event]]] = [
    (
        "The user greets me.\n</think>\n\nHello! How can I help?",
        True,
        [ReasoningDelta("The user greets me."), ContentDelta("Hello! How can I help?")],
    ),
    ("<think>\nHmm.\n</think>\n\nHi", False, [ReasoningDelta("Hmm."), ContentDelta("Hi")]),
    ("\n<think>\nagain\n</think>\nok", True, [ReasoningDelta("again"), ContentDelta("ok")]),
    (
        "Plain answer, a < b and c <= d, <tag> kept.",
        False,
        [ContentDelta("Plain answer, a < b and c <= d, <tag> kept.")],
    ),
    (
        "Need data.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=lookup>\n<parameter=key>\n123\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=lookup>\n"
        "<parameter=key>\nü\nmulti-line\n</parameter>\n</function>\n</tool_call>\n\nThen more text.",
        True,
        [
            ReasoningDelta("Need data."),
            ContentDelta("Let me look."),
            call("lookup", {"key": "123", "n": 2}, 0),
            call("lookup", {"key": "ü\nmulti-line"}, 1),
            ContentDelta("\n\nThen more text."),
        ],
    ),
    (
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "k", "n": 3}}\n</tool_call>',
        False,
        [call("lookup", {"key": "k", "n": 3})],
    ),
    (
        "Trying.\n<tool_call>\n<function=lookup>\n<parameter=key>\nabc",
        False,
        [ContentDelta("Trying.\n<tool_call>\n<function=lookup>\n<parameter=key>\nabc")],
    ),
    (
        "Broken: <tool_call>not a call</tool_call> after",
        False,
        [ContentDelta("Broken: <tool_call>not a call</tool_call> after")],
    ),
    (
        "I should call it.\n<tool_call>\n<function=lookup>\n</function>\n</tool_call>",
        True,
        [ReasoningDelta("I should call it."), call("lookup", {})],
    ),
    ("Unfinished thought", True, [ReasoningDelta("Unfinished thought")]),
    ("Ends with a partial tag <tool_c", False, [ContentDelta("Ends with a partial tag <tool_c")]),
    ("Late <think> is text", False, [ContentDelta("Late <think> is text")]),
    ("   ", False, []),
]


@pytest.mark.parametrize(("text", "starts_in_reasoning", "expected"), SAMPLES)
def test_samples_whole_and_by_character(text: str, starts_in_reasoning: bool, expected: list[Event]) -> None:
    assert merged(parse([text], starts_in_reasoning, TOOLS)) == expected
    assert merged(parse(list(text), starts_in_reasoning, TOOLS)) == expected


@given(data=st.data())
def test_any_split_points_give_the_same_events(data: st.DataObject) -> None:
    text, starts_in_reasoning, expected = data.draw(st.sampled_from(SAMPLES))
    cuts = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert merged(parse(chunks, starts_in_reasoning, TOOLS)) == expected


def test_schema_types_tool_arguments() -> None:
    text = (
        "<tool_call>\n<function=lookup>\n<parameter=key>\n7\n</parameter>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse([text], False, TOOLS) == [call("lookup", {"key": "7", "n": 7})]
    assert parse([text], False, None) == [call("lookup", {"key": 7, "n": 7})]


def test_text_is_released_at_once_except_a_possible_tag() -> None:
    parser = make_parser(False)
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool_c") == [ContentDelta("ld")]
    assert parser.feed("ar is") == [ContentDelta(" <tool_car is")]
    assert parser.feed(" fine\n\n") == [ContentDelta(" fine")]
    assert parser.finish() == []


def test_reasoning_streams_and_a_possible_close_tag_is_held() -> None:
    parser = make_parser(True)
    assert parser.feed("step 1</th") == [ReasoningDelta("step 1")]
    assert parser.feed("ink>\n\nDone") == [ContentDelta("Done")]


def test_stray_think_is_only_recognised_at_the_start() -> None:
    parser = make_parser(False)
    assert parser.feed("\n<thi") == []
    assert parser.feed("nk>a") == [ReasoningDelta("a")]


def test_default_ids_are_random_call_ids() -> None:
    parser = OutputParser(False)
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2
    first, second = parser.feed(text)
    assert isinstance(first, ToolCallEvent) and isinstance(second, ToolCallEvent)
    assert first.call.id.startswith("call_") and len(first.call.id) == 29
    assert first.call.id != second.call.id


def test_feed_after_finish_is_a_bug() -> None:
    parser = make_parser(False)
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=f>",
    "<parameter=a>",
    "</parameter>",
    "</function>",
    '{"name": "g", "arguments": {"b": 1}}',
    "\n",
    " ",
    "x",
    "é",
    "<",
    "</",
    "<tool",
    "7",
]


@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=40),
    starts_in_reasoning=st.booleans(),
    data=st.data(),
)
def test_split_points_never_change_random_tag_soup(
    pieces: list[str], starts_in_reasoning: bool, data: st.DataObject
) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=len(text)), max_size=16)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert merged(parse(chunks, starts_in_reasoning)) == merged(parse([text], starts_in_reasoning))


@given(text=st.text(alphabet=st.sampled_from('ab <>/=_\n{}"')))
def test_text_without_tags_comes_back_whole(text: str) -> None:
    if any(tag in text for tag in ("<think>", "<tool_call>")):
        return
    expected = [ContentDelta(text.strip())] if text.strip() else []
    assert merged(parse(list(text), False)) == expected
