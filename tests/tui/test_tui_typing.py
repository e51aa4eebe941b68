"""Keys that arrive faster than the app handles them: typed ahead, read together with Enter, or sent while
the model is still loading. Every key typed before Enter is part of the message; none after it is."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import Static

from cmpchat.tui.model_request import ModelRequest
from cmpchat.tui.screens.model_picker import ModelPickerScreen
from cmpchat.tui.widgets.messages import ReplyView, UserMessage
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ANSWER, ScriptedModel, scripted_opener
from tests.tui.helpers import chat_screen, current_chat, read_at_once, ready, send, wait_for

pytestmark = pytest.mark.asyncio


async def test_text_and_enter_in_one_read_are_sent(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        read_at_once(pilot, *"Say hello", "enter")
        await wait_for(pilot, lambda: model.calls and not screen.generating, what="the reply")
        assert model.calls[0].messages[-1].content == "Say hello"
        assert screen.query_one(PromptArea).text == ""
        assert screen.query_one(UserMessage).text == "Say hello"


async def test_keys_after_enter_stay_in_the_box_for_the_next_message(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        read_at_once(pilot, *"first", "enter", *"second")
        await wait_for(pilot, lambda: model.calls and not screen.generating, what="the reply")
        assert [call.messages[-1].content for call in model.calls] == ["first"]
        assert screen.query_one(PromptArea).text == "second"


async def test_a_burst_right_after_switching_chats_is_sent_whole(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        for turn in range(4):
            await send(pilot, f"question {turn} of the older chat")
        older = current_chat(screen).id
        await pilot.press("ctrl+n")
        await send(pilot, "the newer chat")
        await screen.open_chat(older)  # the screen is busy laying out the older chat's turns
        screen.query_one(PromptArea).focus()
        burst = "a longer message typed straight after switching"
        read_at_once(pilot, *burst, "enter")
        await wait_for(pilot, lambda: len(model.calls) == 6 and not screen.generating, what="the reply")
        assert model.calls[-1].messages[-1].content == burst
        assert app.history.messages(older)[-2].content == burst


async def test_a_message_refused_while_a_reply_streams_is_kept_with_what_followed(make_app):
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "first", wait=False)
        await wait_for(pilot, lambda: screen.generating)
        read_at_once(pilot, *"second", "enter", *" and more")
        await pilot.pause(0.2)
        assert screen.query_one(PromptArea).text == "second and more"
        gate.set()
        await wait_for(pilot, lambda: not screen.generating)


async def test_enter_while_the_model_loads_sends_once_it_is_ready(make_app):
    loading = threading.Event()
    model = ScriptedModel()

    def slow_open(path: Path | None) -> ScriptedModel:
        loading.wait(10)
        return model

    app = make_app(model, opener=scripted_opener(slow_open))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = chat_screen(pilot)
            await wait_for(pilot, lambda: screen.speed.phase == "loading", what="loading to start")
            read_at_once(pilot, *"are you there?", "enter")
            await wait_for(pilot, lambda: screen.query(UserMessage), what="the message in the conversation")
            assert screen.query_one(PromptArea).text == ""
            assert "waiting for the model" in str(screen.query_one("#waiting-for-model", Static).render())
            assert not model.calls
            loading.set()
            await wait_for(pilot, lambda: model.calls and not screen.generating, what="the reply")
            assert model.calls[0].messages[-1].content == "are you there?"
            assert not screen.query("#waiting-for-model")
            assert [view.content for view in screen.query(ReplyView)] == [ANSWER]
            assert [m.role for m in app.history.messages(current_chat(screen).id)] == ["user", "assistant"]
    finally:
        loading.set()


async def test_a_failed_load_says_so_and_the_next_model_replies(make_app, tmp_path):
    attempts: list[Path | None] = []
    model = ScriptedModel()
    release = threading.Event()

    def fail_then_open(path: Path | None) -> ScriptedModel:
        attempts.append(path)
        if len(attempts) == 1:
            release.wait(10)
            raise OSError("disk on fire")
        return model

    found = tmp_path / "other.gguf"
    found.write_bytes(b"GGUF")
    app = make_app(model, opener=scripted_opener(fail_then_open))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = chat_screen(pilot)
            await wait_for(pilot, lambda: screen.speed.phase == "loading", what="loading to start")
            read_at_once(pilot, *"hello?", "enter")
            await wait_for(pilot, lambda: screen.query("#waiting-for-model"), what="the waiting note")
            release.set()
            await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the picker")
            await pilot.press("escape")
            note = screen.query_one("#waiting-for-model", Static)
            assert "did not load" in str(note.render())
            app.load_model(ModelRequest(found))
            await wait_for(pilot, lambda: model.calls and not screen.generating, what="the reply")
            assert model.calls[0].messages[-1].content == "hello?"
    finally:
        release.set()
