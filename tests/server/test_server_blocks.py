"""A reply's events as blocks (what the Responses and Messages streams are built from)."""

from __future__ import annotations

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import ContentDelta, ReasoningDelta, ToolCallEvent
from cmpchat.server.blocks import BlockClosed, BlockOpened, BlockSplitter, BlockText


def test_runs_of_text_and_each_tool_call_are_blocks_in_order() -> None:
    call = ToolCall(name="f", arguments={"x": 1}, id="call_1")
    splitter = BlockSplitter()
    first = splitter.feed([ReasoningDelta("Hm"), ReasoningDelta("m."), ContentDelta("Let me "), ContentDelta("")])
    assert first == [
        BlockOpened(0, "reasoning"),
        BlockText(0, "reasoning", "Hmm."),
        BlockClosed(0, "reasoning", "Hmm."),
        BlockOpened(1, "text"),
        BlockText(1, "text", "Let me "),
    ]
    second = splitter.feed([ContentDelta("check."), ToolCallEvent(call), ContentDelta("Done.")])
    assert second == [
        BlockText(1, "text", "check."),
        BlockClosed(1, "text", "Let me check."),
        BlockOpened(2, "tool_call", call),
        BlockClosed(2, "tool_call", "", call),
        BlockOpened(3, "text"),
        BlockText(3, "text", "Done."),
    ]
    assert splitter.close() == [BlockClosed(3, "text", "Done.")]
    assert splitter.close() == []
