"""Copying from the conversation with a key: the picked message (the last one unless Alt+Up / Alt+Down picked
another), or one of its code blocks. The text goes through the terminal (OSC 52, `App.copy_to_clipboard`), so
it reaches the clipboard of the machine the person sits at, over SSH too (in tmux: with set-clipboard on)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cmpchat.tui.code_blocks import code_blocks
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.messages import ReplyView, UserMessage

if TYPE_CHECKING:
    from cmpchat.tui.screens.chat_screen import ChatScreen


def message_text(turn: UserMessage | ReplyView) -> str:
    return turn.text if isinstance(turn, UserMessage) else turn.content


def copy_message(screen: ChatScreen) -> None:
    turn = screen.query_one(Conversation).selected_turn()
    text = message_text(turn) if turn is not None else ""
    if not text:
        screen.notify("There is no message text to copy yet.")
        return
    screen.app.copy_to_clipboard(text)
    what = "your message" if isinstance(turn, UserMessage) else "the reply"
    screen.notify(f"Copied {what} to the clipboard: {_size(text)}", timeout=3)


def copy_code_block(screen: ChatScreen) -> None:
    """The picked message's last code block; pressed again, the one before it, round to the last again."""
    turn = screen.query_one(Conversation).selected_turn()
    blocks = code_blocks(message_text(turn)) if turn is not None else []
    if turn is None or not blocks:
        screen.notify("This message has no code block to copy.")
        return
    previous = screen.copied_code
    index = (previous[1] - 1) % len(blocks) if previous and previous[0] is turn else len(blocks) - 1
    screen.copied_code = (turn, index)
    block = blocks[index]
    screen.app.copy_to_clipboard(block.code)
    kind = f"{block.language} " if block.language else ""
    screen.notify(f"Copied {kind}code block {index + 1} of {len(blocks)}: {_size(block.code)}", timeout=3)


def _size(text: str) -> str:
    lines = text.count("\n") + (not text.endswith("\n"))
    return f"{lines} line{'s' if lines != 1 else ''}"
