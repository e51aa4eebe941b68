"""Resizing the terminal while the app is idle or a reply streams, and what an unexpected failure mid-reply
leaves behind: the reply's thread stopped and its text stored."""

from __future__ import annotations

import threading

import pytest

from cmpchat.history.store import HistoryStore
from cmpchat.tui.screens.chat_screen import WIDE
from cmpchat.tui.widgets.messages import ReplyView
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ANSWER, ScriptedModel
from tests.tui.helpers import current_chat, ready, send, wait_for

pytestmark = pytest.mark.asyncio

HEIGHT = 30


async def test_every_width_from_200_to_40_while_a_reply_streams(make_app):
    widths = list(range(200, 39, -1))
    answer = "\n\n".join([ANSWER] * 4)
    pace = threading.Semaphore(0)
    model = ScriptedModel(answer=answer, pieces=len(answer), pace=pace)  # one character a piece
    app = make_app(model)
    async with app.run_test(size=(200, HEIGHT)) as pilot:
        screen = await ready(pilot)
        screen.thinking = False
        await send(pilot, "a long answer please", wait=False)
        for width in widths:
            pace.release()  # one more piece of the answer arrives at each width
            await pilot.resize_terminal(width, HEIGHT)
            await pilot.pause()
        assert screen.generating, "the reply must still be streaming when the last width is reached"
        pace.release(len(answer))
        await wait_for(pilot, lambda: not screen.generating, what="the reply")
        assert screen.query_one(ReplyView).content == answer
        assert app.history.messages(current_chat(screen).id)[-1].status == "complete"


@pytest.mark.parametrize("wide", [200, WIDE])
@pytest.mark.parametrize("narrow", [60, 40])
async def test_a_jump_from_wide_to_narrow_while_a_reply_streams(make_app, wide, narrow):
    """One resize event from the wide layout (chat list and side panel shown) to a width where they no
    longer fit beside the prompt: the first frame at the new width is laid out before the screen's
    narrow classes apply."""
    pace = threading.Semaphore(0)
    model = ScriptedModel(pace=pace)
    app = make_app(model)
    async with app.run_test(size=(wide, HEIGHT)) as pilot:
        screen = await ready(pilot)
        screen.thinking = False
        await send(pilot, "hello", wait=False)
        pace.release()
        await wait_for(pilot, lambda: screen.active_reply and screen.active_reply.view.content, what="first text")
        prompt = screen.query_one(PromptArea)
        prompt.insert("the next question, typed while the reply streams")
        await pilot.resize_terminal(narrow, HEIGHT)
        await pilot.pause()
        pace.release(10)
        await wait_for(pilot, lambda: not screen.generating, what="the reply")
        assert screen.query_one(ReplyView).content == ANSWER
        assert prompt.text == "the next question, typed while the reply streams"
        prompt.clear()  # and the same jump idle, with the placeholder showing
        await pilot.resize_terminal(wide, HEIGHT)
        await pilot.pause()
        await pilot.resize_terminal(narrow, HEIGHT)
        await pilot.pause()


@pytest.mark.parametrize("width", [1, 4, 10])
async def test_a_terminal_narrower_than_the_prompt_border(make_app, width):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(width, HEIGHT)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hi")
        assert screen.query_one(ReplyView).content == ANSWER


async def test_a_failure_mid_reply_stops_the_reply_and_keeps_its_text(make_app):
    """Textual ends the app on an unhandled exception without calling `exit`: the reply's thread must still
    be told to stop (else the process cannot end) and what it wrote must be stored."""
    gate = threading.Event()  # never set: only a cancel ends the reply
    model = ScriptedModel(gate=gate)
    app = make_app(model)

    def fail() -> None:
        raise RuntimeError("a bug somewhere in the app")

    try:
        with pytest.raises(RuntimeError, match="a bug somewhere"):
            async with app.run_test(size=(120, HEIGHT)) as pilot:
                screen = await ready(pilot)
                screen.thinking = False
                await send(pilot, "hello", wait=False)
                await wait_for(pilot, lambda: screen.active_reply and screen.active_reply.view.content)
                chat_id = current_chat(screen).id
                app.call_later(fail)
                await pilot.pause(0.2)
        assert model.ended.wait(2), "the reply's thread is still running after the app ended"
    finally:
        gate.set()
    stored = HistoryStore(app.history.path).messages(chat_id)[-1]
    assert stored.status == "interrupted" and stored.content and ANSWER.startswith(stored.content)
