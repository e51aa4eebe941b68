"""The chat as a person drives it, through Textual's Pilot, on a scripted model: send, stream, stop,
regenerate, edit, thinking toggle, chat settings."""

from __future__ import annotations

import threading

import pytest

from cmpchat.chat.messages import ToolCall
from cmpchat.tui.settings import AppState
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.messages import ReasoningBlock, ReplyView, ToolCallView, UserMessage
from cmpchat.tui.widgets.prompt import PromptArea
from cmpchat.tui.widgets.speed_panel import SpeedPanel
from cmpchat.tui.widgets.title_bar import TitleBar
from tests.tui.fakes import ANSWER, REASONING, ScriptedModel
from tests.tui.helpers import current_chat, plain, ready, send, wait_for

pytestmark = pytest.mark.asyncio


async def test_send_streams_the_reply_and_stores_it(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "Explain the delta rule")
        views = screen.query_one(Conversation).children
        assert [type(v) for v in views] == [UserMessage, ReplyView]
        reply = views[1]
        assert isinstance(reply, ReplyView) and reply.content == ANSWER
        assert "27.4 tok/s" in str(reply.stats_line.render())
        assert screen.query_one(PromptArea).text == ""
        stats = screen.query_one(SpeedPanel).stats
        assert stats.phase == "idle" and stats.decode_rate == pytest.approx(27.4)
        assert stats.first_token_seconds == pytest.approx(1.42)
        assert screen.query_one(TitleBar).context_used == 18_204 + stats.generated
        stored = app.history.messages(current_chat(screen).id)
        assert [(m.role, m.status) for m in stored] == [("user", "complete"), ("assistant", "complete")]
        assert stored[1].content == ANSWER and stored[1].reasoning == REASONING
        assert stored[1].stats["decode_tokens_per_second"] == pytest.approx(27.4)
    assert model.calls[0].messages[-1].content == "Explain the delta rule"


async def test_reasoning_streams_open_then_folds_when_the_answer_starts(make_app):
    gate = threading.Event()
    model = ScriptedModel(pieces=3, gate=gate)
    model.reasoning = "first thought. second thought."
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "think first", wait=False)
        await wait_for(pilot, lambda: screen.query(ReasoningBlock), what="the reasoning block")
        block = screen.query_one(ReasoningBlock)
        assert not block.collapsed and block.title == "thinking…"
        gate.set()
        await wait_for(pilot, lambda: not screen.generating, what="the reply")
        assert block.collapsed and block.title.startswith("thought for ")
        assert block.text == model.reasoning


async def test_tool_calls_show_as_expandable_rows(make_app):
    call = ToolCall("get_weather", {"city": "Oslo"}, "call_1")
    app = make_app(ScriptedModel(tool_call=call))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "weather?")
        row = screen.query_one(ToolCallView)
        assert row.collapsed and "get_weather" in row.title and "Oslo" in row.title
        stored = app.history.messages(current_chat(screen).id)[-1]
        assert stored.tool_calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call_1"}]


async def test_escape_stops_at_once_and_keeps_what_was_written(make_app):
    gate = threading.Event()  # never set: the reply waits after its first piece until stopped
    model = ScriptedModel(gate=gate)
    app = make_app(model, settings=None)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        screen.thinking = False
        await send(pilot, "a long answer please", wait=False)
        await wait_for(pilot, lambda: screen.active_reply and screen.active_reply.view.content, what="first text")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.generating, timeout=2, what="the stop")
        reply = screen.query_one(ReplyView)
        assert reply.content and len(reply.content) < len(ANSWER)
        assert "stopped" in str(reply.stats_line.render())
        stored = app.history.messages(current_chat(screen).id)[-1]
        assert stored.status == "stopped" and stored.content == reply.content


async def test_enter_while_a_reply_streams_keeps_the_text(make_app):
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "first", wait=False)
        await wait_for(pilot, lambda: screen.generating)
        await send(pilot, "second", wait=False)
        assert screen.query_one(PromptArea).text == "second"
        gate.set()
        await wait_for(pilot, lambda: not screen.generating)


async def test_regenerate_replaces_the_last_reply(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hello")
        model.answer = "A different answer."
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(model.calls) == 2 and not screen.generating)
        await pilot.pause()
        replies = screen.query(ReplyView)
        assert len(replies) == 1 and replies.first().content == "A different answer."
        stored = app.history.messages(current_chat(screen).id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == "A different answer."
    assert model.calls[0].messages == model.calls[1].messages


async def test_edit_last_puts_the_message_back_and_resends_it(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "one")
        await send(pilot, "tow")
        await pilot.press("ctrl+e")
        await pilot.pause()
        prompt = screen.query_one(PromptArea)
        assert prompt.text == "tow"
        assert len(screen.query(UserMessage)) == 1 and len(screen.query(ReplyView)) == 1
        prompt.clear()
        await send(pilot, "two")
        stored = app.history.messages(current_chat(screen).id)
        assert [m.content for m in stored if m.role == "user"] == ["one", "two"]
    assert [m.content for m in model.calls[-1].messages if m.role == "user"] == ["one", "two"]


async def test_ctrl_j_adds_a_line_instead_of_sending(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        prompt = screen.query_one(PromptArea)
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb" and not model.calls
        await pilot.press("enter")
        await wait_for(pilot, lambda: model.calls and not screen.generating)
    assert model.calls[0].messages[-1].content == "a\nb"


async def test_thinking_toggle_applies_to_the_next_turn_and_is_remembered(make_app, tmp_path):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert screen.query_one(TitleBar).thinking is True
        await send(pilot, "with thinking")
        await pilot.press("ctrl+t")
        assert screen.query_one(TitleBar).thinking is False
        assert "thinking off" in str(screen.query_one(PromptArea).border_subtitle)
        await send(pilot, "without")
    assert [call.enable_thinking for call in model.calls] == [True, False]
    assert app.app_state.thinking is False
    again = make_app(ScriptedModel(), fresh_state=False)
    assert again.app_state.thinking is False  # read back from state.json


async def test_chat_settings_dialog_sets_system_prompt_and_sampling(make_app):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        dialog = app.screen
        dialog.query_one("#system-prompt").text = "You are terse."
        dialog.query_one("#temperature").value = "0"
        dialog.query_one("#max_tokens").value = "99"
        await pilot.click("#save")
        await pilot.pause()
        assert app.screen is screen
        await send(pilot, "hi")
        assert screen.session.options.temperature == 0 and screen.session.options.max_tokens == 99
        assert app.history.chat(current_chat(screen).id).settings["system_prompt"] == "You are terse."
    call = model.calls[0]
    assert call.messages[0].role == "system" and call.messages[0].content == "You are terse."
    assert call.max_tokens == 99


async def test_chat_settings_dialog_refuses_bad_values(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        dialog = app.screen
        dialog.query_one("#top_p").value = "1.5"
        await pilot.click("#save")
        await pilot.pause()
        assert app.screen is dialog
        assert "top_p" in str(dialog.query_one("#settings-error").render())


async def test_keys_respond_while_a_reply_streams(make_app):
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate), state=AppState(thinking=False))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "go", wait=False)
        await wait_for(pilot, lambda: screen.generating)
        await pilot.press("x", "y")
        assert screen.query_one(PromptArea).text == "xy"
        await pilot.press("ctrl+t")
        assert screen.thinking is True
        gate.set()
        await wait_for(pilot, lambda: not screen.generating)


async def test_html_and_xml_in_a_reply_are_shown_as_written(make_app):
    answer = (
        'Line one<br>line two, in a <div class="x">box</div>.\n\n<div class="note">\nA block\n</div>\n\n'
        "The tag <think> is literal here."
    )
    reasoning = "Should I use <br> or a blank line?"
    app = make_app(ScriptedModel(answer=answer, reasoning=reasoning))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "how do I break a line in HTML?")
        reply = screen.query_one(ReplyView)
        shown = "\n".join(plain(block) for block in reply.markdown.query("MarkdownParagraph"))
        assert 'Line one<br>line two, in a <div class="x">box</div>.' in shown
        assert '<div class="note"> A block </div>' in shown  # its lines joined, as any paragraph's
        assert "The tag <think> is literal here." in shown
        thought = reply.query_one(ReasoningBlock).query("MarkdownParagraph")
        assert "\n".join(plain(block) for block in thought) == reasoning


async def test_a_reply_stopped_while_thinking_no_longer_says_thinking(make_app):
    gate = threading.Event()  # never set: the reply waits in its reasoning until stopped
    app = make_app(ScriptedModel(gate=gate))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "think hard", wait=False)
        await wait_for(pilot, lambda: screen.query(ReasoningBlock), what="the reasoning block")
        block = screen.query_one(ReasoningBlock)
        assert block.title == "thinking…"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.generating, timeout=2, what="the stop")
        assert block.title.startswith("thought for ")
        assert "stopped" in str(screen.query_one(ReplyView).stats_line.render())
