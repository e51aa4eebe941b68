"""The code blocks of a message's Markdown (fenced or indented), for copying one with a key."""

from __future__ import annotations

from dataclasses import dataclass

from cmpchat.tui.widgets.streamed_markdown import shared_parser


@dataclass(frozen=True, slots=True)
class CodeBlock:
    language: str
    """The fence's info word ("python"); "" when it names none."""
    code: str


def code_blocks(markdown: str) -> list[CodeBlock]:
    """Every code block in `markdown`, in order, parsed as the message is drawn."""
    return [
        CodeBlock(token.info.split(maxsplit=1)[0] if token.info.strip() else "", token.content)
        for token in shared_parser().parse(markdown)
        if token.type in ("fence", "code_block")
    ]
