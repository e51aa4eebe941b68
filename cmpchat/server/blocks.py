"""A reply's engine events as a sequence of blocks, the structure both the Responses and the Messages API stream:
each run of reasoning or of answer text is one block, each tool call one. The APIs name them differently (output
items; content blocks) and wrap them in their own events, from these. A text block carries the log-probabilities
of its tokens when the request asked for them (`LogprobRouter` says which tokens are whose)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import ContentDelta, ReasoningDelta, ToolCallEvent
from cmpchat.engine.request import EngineEvent
from cmpchat.sampling import TokenLogprobs
from cmpchat.server.logprobs import LogprobRouter

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(frozen=True, slots=True)
class BlockOpened:
    index: int
    kind: BlockKind
    call: ToolCall | None = None
    """A tool call block's call, whole: the engine parses a call completely before it reports it."""


@dataclass(frozen=True, slots=True)
class BlockText:
    index: int
    kind: BlockKind
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    """The tokens whose text this is the first to carry."""


@dataclass(frozen=True, slots=True)
class BlockClosed:
    index: int
    kind: BlockKind
    text: str
    """All the block's text ("" for a tool call)."""
    call: ToolCall | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """All the block's tokens (none for a tool call)."""


BlockEvent = BlockOpened | BlockText | BlockClosed


class BlockSplitter:
    """Turns event batches into block events; a batch's text deltas of one block come out as one `BlockText`."""

    def __init__(self) -> None:
        self._count = 0
        self._open: BlockKind | None = None
        self._text: list[str] = []
        self._logprobs: list[TokenLogprobs] = []
        self._router = LogprobRouter()

    def feed(self, events: Sequence[EngineEvent]) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for event in events:
            taken = tuple(self._router.route(event))
            if isinstance(event, ToolCallEvent):
                out += self._close()
                index = self._next_index()
                out += [BlockOpened(index, "tool_call", event.call), BlockClosed(index, "tool_call", "", event.call)]
            elif isinstance(event, ReasoningDelta | ContentDelta) and event.text:
                kind: BlockKind = "reasoning" if isinstance(event, ReasoningDelta) else "text"
                if self._open != kind:
                    out += self._close()
                    self._open = kind
                    out.append(BlockOpened(self._next_index(), kind))
                self._text.append(event.text)
                self._logprobs += taken
                last = out[-1] if out else None
                if isinstance(last, BlockText):
                    out[-1] = BlockText(last.index, kind, last.text + event.text, last.logprobs + taken)
                else:
                    out.append(BlockText(self._count - 1, kind, event.text, taken))
        return out

    def close(self) -> list[BlockEvent]:
        """The end of the open block, if any (call once the reply is over)."""
        return self._close()

    def _next_index(self) -> int:
        self._count += 1
        return self._count - 1

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        closed = BlockClosed(self._count - 1, self._open, "".join(self._text), logprobs=tuple(self._logprobs))
        self._open, self._text, self._logprobs = None, [], []
        return [closed]
