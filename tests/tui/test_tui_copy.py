"""Copying with keys (OSC 52 through `App.copy_to_clipboard`): the picked message, its code blocks in turn;
the keys clash with no other; and the command palette holds every action."""

from __future__ import annotations

import pytest
from textual.binding import Binding
from textual.command import CommandList, CommandPalette
from textual.screen import Screen

from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.code_blocks import CodeBlock, code_blocks
from cmpchat.tui.screens.chat_screen import ChatScreen
from cmpchat.tui.screens.dialogs import TextInputDialog
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.messages import ReplyView, UserMessage
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ScriptedModel
from tests.tui.helpers import ready, send, wait_for

ANSWER = "Two ways:\n\n```python\nprint('one')\n```\n\nor\n\n```sh\necho two\necho three\n```\n"


def keys_of(bindings) -> list[str]:
    return [key.strip() for b in bindings if isinstance(b, Binding) for key in b.key.split(",")]


def test_code_blocks_are_found_with_their_language():
    assert code_blocks(ANSWER) == [CodeBlock("python", "print('one')\n"), CodeBlock("sh", "echo two\necho three\n")]
    assert code_blocks("    indented code\n") == [CodeBlock("", "indented code\n")]
    assert code_blocks("no code, only `inline`") == []


def test_the_chat_keys_clash_with_no_other_key():
    chat = keys_of(ChatScreen.BINDINGS)
    assert len(chat) == len(set(chat))
    # The prompt has the focus most of the time: a key it takes never reaches the chat screen.
    assert not set(chat) & set(keys_of(PromptArea.BINDINGS))
    assert not set(chat) & set(keys_of(CmpchatApp.BINDINGS)) and not set(chat) & set(keys_of(Screen.BINDINGS))


@pytest.mark.asyncio
async def test_f8_copies_the_picked_message_and_f9_its_code_blocks_in_turn(make_app):
    app = make_app(ScriptedModel(answer=ANSWER))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("f8", "f9")
        assert app.clipboard == ""  # nothing to copy yet: each says so in one line
        await send(pilot, "How do I print?")
        await pilot.press("f8")
        assert app.clipboard == ANSWER
        await pilot.press("f9")
        assert app.clipboard == "echo two\necho three\n"
        await pilot.press("f9")
        assert app.clipboard == "print('one')\n"
        await pilot.press("f9")
        assert app.clipboard == "echo two\necho three\n"  # round to the last again
        await pilot.press("alt+up")
        picked = screen.query_one(Conversation).selected_turn()
        assert isinstance(picked, UserMessage) and picked.has_class("-selected")
        await pilot.press("f8")
        assert app.clipboard == "How do I print?"
        await pilot.press("f9")
        assert app.clipboard == "How do I print?"  # a message without code: nothing copied
        assert "no code block" in list(app._notifications)[-1].message
        await pilot.press("alt+down")
        assert isinstance(screen.query_one(Conversation).selected_turn(), ReplyView)
        await pilot.press("alt+up")
        await send(pilot, "And in Rust?")
        assert not screen.query(".-selected")  # a new message: the keys copy the newest again
        await pilot.press("f8")
        assert app.clipboard.startswith("Two ways:")


async def palette_titles(pilot, search: str) -> list[str]:
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    await pilot.press(*search)
    options = pilot.app.screen.query_one(CommandList)
    await wait_for(pilot, lambda: options.option_count, what=f"commands matching {search!r}")
    await pilot.pause(0.3)
    titles = [options.get_option_at_index(i).prompt for i in range(options.option_count)]
    return [str(getattr(title, "plain", title)) for title in titles]


@pytest.mark.asyncio
async def test_the_palette_has_every_action(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hello")
        titles = [command.title for command in app.get_system_commands(screen)]
        for binding in ChatScreen.BINDINGS:
            assert isinstance(binding, Binding)
            if binding.action != "stop":  # Esc's stop is offered only while a reply is written
                assert binding.tooltip in titles
        assert {"Rename this chat", "Delete this chat", "All keys", "Quit", "Screenshot", "Theme"} <= set(titles)
        found = await palette_titles(pilot, "rename")
        assert "Rename this chat" in found[0]
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputDialog), what="the rename dialog")
