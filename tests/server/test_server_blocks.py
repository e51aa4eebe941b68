"""A reply's events as blocks (what the Responses and Messages streams are built from)."""

from __future__ import annotations

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import ContentDelta, ReasoningDelta, ToolCallEvent
from cmpchat.engine.request import EngineEvent
from cmpchat.sampling import TokenLogprobs
from cmpchat.server.blocks import BlockClosed, BlockOpened, BlockSplitter, BlockText
from cmpchat.server.responses import Outcome


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


def test_each_token_goes_with_the_first_text_after_it() -> None:
    call = ToolCall(name="f", arguments={}, id="call_1")
    t = [TokenLogprobs(i, -0.5, ()) for i in range(7)]
    # A reasoning token, the closing tag's token (no text of its own), two tokens of one character, a tool call's
    # token, an answer token, and a stop string's token that no text follows.
    events: list[EngineEvent] = [t[0], ReasoningDelta("Hm"), t[1], t[2], t[3], ContentDelta("é"), t[4]]
    events += [ToolCallEvent(call), t[5], ContentDelta("Ok"), t[6]]
    splitter = BlockSplitter()
    blocks = splitter.feed(events[:6]) + splitter.feed(events[6:]) + splitter.close()
    texts = {(b.index, b.kind): b.logprobs for b in blocks if isinstance(b, BlockText)}
    assert texts == {(0, "reasoning"): (t[0],), (1, "text"): (t[1], t[2], t[3]), (3, "text"): (t[5],)}
    closed = [b.logprobs for b in blocks if isinstance(b, BlockClosed)]
    assert closed == [(t[0],), (t[1], t[2], t[3]), (), (t[5],)]
    # The whole answer's tokens, as a response that is not streamed reports them: the same.
    outcome = Outcome(10, logprobs=[])
    for event in events:
        outcome.absorb(event)
    assert outcome.logprobs == t and outcome.content_logprobs == [t[1], t[2], t[3], t[5]]
    assert Outcome(10).content_logprobs == []
