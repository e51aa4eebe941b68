"""Slash commands in the prompt: each runs its action and sends nothing to the model; an unknown one is one
line and its text goes back to the prompt; `//` sends a literal `/`, and Qwen's /think switches are sent as
written; Tab completes a command's name."""

from __future__ import annotations

import pytest

from cmpchat.tui.screens.chat_settings import ChatSettingsScreen
from cmpchat.tui.screens.dialogs import TextInputDialog
from cmpchat.tui.screens.model_picker import ModelPickerScreen
from cmpchat.tui.slash_commands import COMMANDS, CommandCall, completion, parse
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ScriptedModel
from tests.tui.helpers import ready, send, wait_for


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


def test_commands_and_messages_are_told_apart():
    assert parse("/temp 0.2") == CommandCall("temp", "0.2")
    assert parse("/system  Be brief.  ") == CommandCall("system", "Be brief.")
    assert parse("/new") == CommandCall("new", "")
    assert parse("/system\nTwo lines,\nkept.") == CommandCall("system", "Two lines,\nkept.")
    assert parse("/") == CommandCall("", "") and parse("/ x") == CommandCall("", "x")
    assert parse("/usr/bin is gone") == CommandCall("usr/bin", "is gone")  # unknown: refused, not sent
    assert parse("//usr/bin is gone") == "/usr/bin is gone"
    assert parse("/no_think Quick: 2+2?") == "/no_think Quick: 2+2?"
    assert parse("/think") == "/think"
    assert parse("plain text") == "plain text"


def test_completion_adds_the_rest_of_a_commands_name():
    assert completion("/") == "system "
    assert completion("/te") == "mp "
    assert completion("/mo") == "del"
    assert completion("/cl") == "ear"
    assert completion("/temp") == "" and completion("/temp 0") == "" and completion("//s") == ""
    assert completion("/x") == "" and completion("hello") == ""
    assert {c.name for c in COMMANDS} == {"system", "temp", "model", "new", "export", "clear"}


async def type_and_send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptArea)
    prompt.focus()
    prompt.insert(text)
    await pilot.press("enter")
    await pilot.pause()


@pytest.mark.asyncio
async def test_system_and_temp_change_the_chat_and_send_nothing(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await type_and_send(pilot, "/system You answer in French.")
        await type_and_send(pilot, "/temp 0.2")
        assert screen.session.options.system_prompt == "You answer in French."
        assert screen.session.options.temperature == 0.2
        assert not model.calls and screen.session.messages == []
        assert screen.query_one(PromptArea).text == ""
        await type_and_send(pilot, "/temp warm")
        assert any("/temp warm: the temperature is a number" in n for n in notices(app))
        assert screen.query_one(PromptArea).text == "/temp warm"  # given back to be fixed
        screen.query_one(PromptArea).clear()
        await type_and_send(pilot, "/temp -1")
        assert any("temperature must be >= 0" in n for n in notices(app))
        assert screen.session.options.temperature == 0.2
        screen.query_one(PromptArea).clear()
        await send(pilot, "Bonjour?")
        call = model.calls[0]
        assert call.messages[0].content == "You answer in French." and call.temperature == 0.2
        await type_and_send(pilot, "/temp")
        assert isinstance(app.screen, ChatSettingsScreen)


@pytest.mark.asyncio
async def test_model_new_export_and_clear_run_their_actions(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "A first chat")
        await type_and_send(pilot, "/export")
        assert isinstance(app.screen, TextInputDialog)
        await pilot.press("escape")
        await type_and_send(pilot, "/model")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the model picker")
        await pilot.press("escape")
        await pilot.pause()
        first = screen.session.chat
        await type_and_send(pilot, "/new")
        assert screen.session.chat is None and first is not None
        await send(pilot, "A second chat")
        second = screen.session.chat
        await type_and_send(pilot, "/clear")
        assert screen.session.chat is None and second is not None and second.id != first.id
        assert [c.messages[-1].content for c in model.calls] == ["A first chat", "A second chat"]
        await type_and_send(pilot, "/new chat please")
        assert any("/new takes nothing after it" in n for n in notices(app))


@pytest.mark.asyncio
async def test_an_unknown_command_is_one_line_and_a_double_slash_sends_a_slash(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await type_and_send(pilot, "/usr/bin/env is missing")
        line = notices(app)[-1]
        assert line.startswith("/usr/bin/env is not a command") and "//" in line and "\n" not in line
        assert not model.calls and screen.query_one(PromptArea).text == "/usr/bin/env is missing"
        screen.query_one(PromptArea).clear()
        await send(pilot, "//usr/bin/env is missing")
        await send(pilot, "/no_think Quick one")
        assert [c.messages[-1].content for c in model.calls] == ["/usr/bin/env is missing", "/no_think Quick one"]


@pytest.mark.asyncio
async def test_tab_completes_a_commands_name_and_otherwise_moves_the_focus(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        prompt = screen.query_one(PromptArea)
        prompt.focus()
        await pilot.press("slash", "t", "e")
        assert prompt.suggestion == "mp "
        await pilot.press("left")
        assert prompt.suggestion == ""  # only at the end of the text
        await pilot.press("end")
        assert prompt.suggestion == "mp "
        await pilot.press("tab")
        assert prompt.text == "/temp " and prompt.suggestion == "" and prompt.has_focus
        await pilot.press("1", "enter")
        await pilot.pause()
        assert screen.session.options.temperature == 1.0
        prompt.insert("not a command")
        await pilot.press("tab")
        assert not prompt.has_focus
