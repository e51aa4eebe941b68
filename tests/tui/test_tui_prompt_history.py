"""Up and Down in the prompt: the messages sent in the open chat, the draft kept and given back, and a message
of several lines still edited line by line."""

from __future__ import annotations

import pytest

from cmpchat.tui.prompt_history import PromptHistory
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ScriptedModel
from tests.tui.helpers import ready, send


def test_back_and_forward_through_the_sent_messages_to_the_draft():
    history = PromptHistory(lambda: ["one", "two", "two", "three"])
    assert history.back("draft") == "three"
    assert history.back("three") == "two"  # "two" sent twice in a row: one step
    assert history.back("two") == "one"
    assert history.back("one") is None  # the oldest: nothing before it
    assert history.forward("one") == "two"
    assert history.forward("two") == "three"
    assert history.forward("three") == "draft"
    assert history.forward("draft") is None  # not browsing: Down is the cursor's


def test_an_edited_recall_becomes_the_draft():
    history = PromptHistory(lambda: ["one", "two"])
    assert history.back("") == "two"
    assert history.forward("two, edited") is None
    assert history.back("two, edited") == "two"
    assert history.forward("two") == "two, edited"
    assert PromptHistory(lambda: []).back("typed") is None


def prompt_of(pilot) -> PromptArea:
    return pilot.app.screen.query_one(PromptArea)


@pytest.mark.asyncio
async def test_up_recalls_this_chats_messages_and_down_brings_the_draft_back(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        for text in ("first question", "second question", "third question"):
            await send(pilot, text)
        prompt = prompt_of(pilot)
        prompt.insert("a draft")
        await pilot.press("up")
        assert prompt.text == "third question" and prompt.cursor_location == prompt.document.end
        seen = []
        for _ in range(3):
            await pilot.press("up")
            seen.append(prompt.text)
        assert seen == ["second question", "first question", "first question"]
        await pilot.press("down", "down")
        assert prompt.text == "third question"
        await pilot.press("down")
        assert prompt.text == "a draft"
        await pilot.press("down")
        assert prompt.text == "a draft"
        await pilot.press("up", "enter")
        await pilot.pause()
        await pilot.press("ctrl+n")
        await pilot.press("up")
        assert prompt_of(pilot).text == ""  # a new chat has no messages to recall


@pytest.mark.asyncio
async def test_up_and_down_move_between_the_lines_of_a_message_before_recalling(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "sent line one\nsent line two")
        prompt = prompt_of(pilot)
        prompt.insert("draft one")
        await pilot.press("ctrl+j")
        prompt.insert("draft two")
        await pilot.press("up")
        assert prompt.text == "draft one\ndraft two" and prompt.cursor_location[0] == 0
        await pilot.press("up")
        assert prompt.text == "sent line one\nsent line two" and prompt.cursor_location[0] == 1
        await pilot.press("up")
        assert prompt.cursor_location[0] == 0 and prompt.text == "sent line one\nsent line two"
        await pilot.press("down", "down")
        assert prompt.text == "draft one\ndraft two"
        await pilot.press("up", "up", "ctrl+z")
        assert prompt.text == "draft one\ndraft two"  # a recall is an edit: undo gives the draft back
        await pilot.press("shift+up", "shift+up")
        assert prompt.text == "draft one\ndraft two" and prompt.selected_text  # selecting never recalls


@pytest.mark.asyncio
async def test_the_keys_list_has_the_history_keys(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one("#help-table")
        ids = [str(table.get_row_at(i)[2]) for i in range(table.row_count)]  # type: ignore[attr-defined]
        assert "prompt.earlier" in ids and "prompt.later" in ids
