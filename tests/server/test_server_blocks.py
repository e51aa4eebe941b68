"""A reply's events as blocks (what the Responses and Messages streams are built from), and the stop sequence that
ended a reply, found again from its tokens."""

from __future__ import annotations

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import ContentDelta, Finished, ReasoningDelta, Timings, ToolCallEvent
from cmpchat.server.anthropic_messages import matched_stop
from cmpchat.server.blocks import BlockClosed, BlockOpened, BlockSplitter, BlockText
from tests.server.live import LiveServer


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


def finished(reason: str, token_ids: list[int]) -> Finished:
    timings = Timings(1, 0.1, len(token_ids), len(token_ids), 0.1, 0.01)
    return Finished(reason, "", "", (), timings, tuple(token_ids))  # type: ignore[arg-type]


def test_the_stop_sequence_that_ended_a_reply(scripted_server: LiveServer) -> None:
    tokenizer = scripted_server.served.tokenizer
    tokens = tokenizer.encode("one, two. three")
    assert matched_stop(tokenizer, finished("stop", tokens[:10]), ["three", ". "]) == ". "
    # The first one completed ends it; of several completed by one token, the one that starts first.
    assert matched_stop(tokenizer, finished("stop", tokens[:9]), ["two.", "two"]) == "two"
    assert matched_stop(tokenizer, finished("stop", tokens[:9]), ["o.", "wo.", "two."]) == "two."
    # An end token, or another reason, ended it: no stop sequence did.
    end = next(iter(tokenizer.eos_token_ids))
    assert matched_stop(tokenizer, finished("stop", [*tokens[:3], end]), ["two"]) is None
    assert matched_stop(tokenizer, finished("length", tokens), [". "]) is None
    assert matched_stop(tokenizer, finished("stop", tokens), []) is None
