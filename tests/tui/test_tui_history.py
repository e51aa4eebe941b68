"""Chats on disk through the app: image attach, restart, interrupted replies, search, rename, delete,
export."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from PIL import Image
from textual.widgets import Input, Label

from cmpchat.chat.messages import ImagePart
from cmpchat.history.store import HistoryStore
from cmpchat.tui.screens.dialogs import ConfirmDialog, TextInputDialog
from cmpchat.tui.screens.image_picker import ImagePickerScreen
from cmpchat.tui.screens.overlays import ChatListScreen
from cmpchat.tui.session import ReplyStats
from cmpchat.tui.widgets.chat_list import ChatList, ChatRows
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.messages import ReplyView, UserMessage
from cmpchat.tui.widgets.prompt import AttachmentBar, PromptArea
from tests.tui.fakes import ScriptedModel, scripted_opener
from tests.tui.helpers import chat_screen, current_chat, ready, send, wait_for

pytestmark = pytest.mark.asyncio


def make_image(path: Path, colour: str = "red") -> Path:
    Image.new("RGB", (32, 24), colour).save(path)
    return path


async def attach(pilot, path: Path) -> None:
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ImagePickerScreen), what="the image picker")
    picker = pilot.app.screen
    picker.query_one("#image-path").value = str(path)
    picker.query_one("#image-path").focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(pilot.app.screen, ImagePickerScreen), what="the picker to close")


async def test_image_attach_stores_once_and_says_the_model_cannot_see_it(make_app, tmp_path):
    model = ScriptedModel()
    app = make_app(model)
    image = make_image(tmp_path / "cat.png")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await attach(pilot, image)
        bar = screen.query_one(AttachmentBar)
        assert len(bar.attachments) == 1 and bar.attachments[0].name == "cat.png"
        assert bar.display and "cannot see images" in str(bar.query_one(".attachment-warning").render())
        await send(pilot, "what is this?", wait=False)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), what="the no-vision warning")
        assert not model.calls  # nothing is sent before the person has been told
        await pilot.click("#yes")
        await wait_for(pilot, lambda: model.calls and not screen.generating)
        await pilot.pause()
        stored = app.history.messages(current_chat(screen).id)[0]
        assert len(stored.images) == 1 and app.images.path(stored.images[0]).exists()
        assert screen.query_one(UserMessage).images == [app.images.path(stored.images[0])]
        # The same picture again is stored once.
        await attach(pilot, image)
        assert screen.query_one(AttachmentBar).attachments[0].image.id == stored.images[0]
    sent = model.calls[0].messages[-1]
    assert sent.content == "what is this?" and not sent.images  # no pretend path: the image is not sent
    assert len(list((tmp_path / "images").rglob("*.png"))) == 1


async def test_cancelling_the_no_vision_warning_sends_nothing(make_app, tmp_path):
    model = ScriptedModel()
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await attach(pilot, make_image(tmp_path / "dog.png", "blue"))
        await send(pilot, "and this?", wait=False)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#no")
        await pilot.pause()
        assert not model.calls and screen.session.chat is None
        assert screen.query_one("#prompt", PromptArea).text == "and this?"


async def test_a_model_with_vision_gets_the_image(make_app, tmp_path):
    model = ScriptedModel(supports_images=True)
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await attach(pilot, make_image(tmp_path / "a.png"))
        await send(pilot, "describe")
    images = model.calls[0].messages[-1].images
    assert len(images) == 1 and isinstance(images[0], ImagePart) and Path(images[0].ref).exists()


async def test_history_survives_a_restart(make_app):
    app = make_app(ScriptedModel(), fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "remember me")
        await send(pilot, "and this")
    again = make_app(ScriptedModel(answer="new"), fresh_state=False)
    async with again.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        turns = screen.query_one(Conversation).children
        assert [type(t) for t in turns] == [UserMessage, ReplyView, UserMessage, ReplyView]
        assert current_chat(screen).title == "remember me"
        rows = screen.query_one(ChatRows)
        assert rows.option_count == 1 and "remember me" in str(rows.get_option_at_index(0).prompt)


async def test_replies_keep_the_label_of_the_model_that_wrote_them(make_app):
    first = ScriptedModel(path=Path("Qwen3.5-9B-Q8_0.gguf"))
    app = make_app(first, fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
    loading = threading.Event()
    second = ScriptedModel(path=Path("Qwen3.6-27B-Q8_0.gguf"))

    def slow_open(path: Path | None) -> ScriptedModel:
        loading.wait(10)
        return second

    again = make_app(second, fresh_state=False, opener=scripted_opener(slow_open))
    try:
        async with again.run_test(size=(120, 40)) as pilot:
            screen = chat_screen(pilot)
            await wait_for(pilot, lambda: screen.query(ReplyView), what="the stored reply")
            assert reply_labels(screen) == ["Qwen3.5-9B-Q8_0.gguf"]  # shown before any model has loaded
            loading.set()
            await ready(pilot)
            await send(pilot, "and now?")
            assert reply_labels(screen) == ["Qwen3.5-9B-Q8_0.gguf", "Qwen3.6-27B-Q8_0.gguf"]
            assert current_chat(screen).model == "Qwen3.6-27B-Q8_0.gguf"
    finally:
        loading.set()


async def test_a_restarted_app_shows_token_counts_as_whole_numbers(make_app):
    app = make_app(ScriptedModel(), fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hello")
        live = str(screen.query_one(ReplyView).stats_line.render())
    again = make_app(ScriptedModel(), fresh_state=False)
    async with again.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        stored = str(screen.query_one(ReplyView).stats_line.render())
    assert re.search(r" · \d+ tokens · ", stored) and stored == live
    old_row = ReplyStats.from_dict({"generated_tokens": 2.0, "prompt_tokens": 18.0, "time_to_first_token": 1.5})
    assert (old_row.generated_tokens, old_row.prompt_tokens) == (2, 18) and isinstance(old_row.generated_tokens, int)


def reply_labels(screen) -> list[str]:
    return [str(view.query_one(".role", Label).render()) for view in screen.query(ReplyView)]


async def test_quitting_mid_reply_keeps_the_partial_reply_marked_interrupted(make_app):
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        screen.thinking = False
        await send(pilot, "long", wait=False)
        await wait_for(pilot, lambda: screen.active_reply and screen.active_reply.view.content)
        chat_id = current_chat(screen).id
        await pilot.press("ctrl+q")
    gate.set()
    stored = HistoryStore(app.history.path).messages(chat_id)[-1]
    assert stored.status == "interrupted" and stored.content


async def test_a_reply_left_streaming_by_a_killed_app_is_marked_interrupted(make_app, tmp_path):
    store = HistoryStore(tmp_path / "history.sqlite3")
    chat = store.create_chat("crashed")
    store.add_message(chat.id, "user", "hi")
    store.add_message(chat.id, "assistant", "half a rep", status="streaming")
    store.close()
    app = make_app(ScriptedModel(), fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.pause()
        assert any("interrupted" in n.message for n in app._notifications)
        screen = pilot.app.screen
        await screen.open_chat(chat.id)
        reply = screen.query_one(ReplyView)
        assert reply.content == "half a rep" and "interrupted" in str(reply.stats_line.render())
    assert HistoryStore(tmp_path / "history.sqlite3").messages(chat.id)[-1].status == "interrupted"


async def test_search_finds_chats_by_title_and_by_message_text(make_app):
    model = ScriptedModel(answer="Paris is the capital.")
    app = make_app(model)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "capital of France?")
        model.answer = "Silicon dreams in HBM2."
        await pilot.press("ctrl+n")
        await send(pilot, "a poem about GPUs")
        await pilot.press("ctrl+f")
        await pilot.press(*"pari")
        await pilot.pause()
        rows = screen.query_one(ChatRows)
        assert rows.option_count == 1
        assert "capital of France" in str(rows.get_option_at_index(0).prompt)
        assert "Paris" in str(rows.get_option_at_index(0).prompt)  # the snippet shows the matching text
        await pilot.press("enter")  # search box: jump to the first hit
        await pilot.press("enter")  # open it
        await pilot.pause()
        assert current_chat(screen).title == "capital of France?"


async def test_rename_and_delete_from_the_chat_list(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "first chat")
        chat_id = current_chat(screen).id
        screen.query_one(ChatRows).focus()
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputDialog))
        app.screen.query_one("#dialog-input").value = "Renamed"
        await pilot.press("enter")
        await pilot.pause()
        assert app.history.chat(chat_id).title == "Renamed"
        assert "Renamed" in str(screen.query_one(ChatRows).get_option_at_index(0).prompt)
        screen.query_one(ChatRows).focus()
        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#yes")
        await pilot.pause()
        assert app.history.chat(chat_id) is None and screen.session.chat is None
        assert not screen.query(UserMessage)


async def test_after_a_delete_the_next_chat_is_selected_in_the_list(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        for title in ("oldest", "middle", "newest"):
            await pilot.press("ctrl+n")
            await send(pilot, title)
        rows = screen.query_one(ChatRows)

        async def delete_highlighted() -> None:
            rows.focus()
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await pilot.click("#yes")
            await wait_for(pilot, lambda: app.screen is screen)
            await pilot.pause()

        def highlighted_title() -> str:
            assert rows.highlighted is not None, "nothing is selected"
            chat_id = rows.highlighted_chat()
            assert chat_id is not None
            return app.history.chat(chat_id).title

        rows.highlighted = 1  # "middle", not the open chat
        await delete_highlighted()
        assert rows.option_count == 2 and highlighted_title() == "oldest"  # the next one took its row
        assert screen.focused is rows
        rows.highlighted = 0  # "newest", the open chat
        await delete_highlighted()
        assert screen.session.chat is None and highlighted_title() == "oldest"
        assert screen.focused is rows


@pytest.mark.parametrize("size", [(160, 48), (80, 24)])
async def test_slash_in_the_chat_list_goes_to_search(make_app, size):
    app = make_app(ScriptedModel())
    async with app.run_test(size=size) as pilot:
        screen = await ready(pilot)
        await send(pilot, "a chat about slashes")
        screen.query_one(PromptArea).focus()
        await pilot.press("slash")
        assert screen.query_one(PromptArea).text == "/"  # in the prompt it is a character
        if size[0] < 120:
            await pilot.press("f2")  # the chat list as an overlay
            await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen))
        app.screen.query_one(ChatRows).focus()
        await pilot.press("slash", *"slash")
        search = app.screen.query_one("#chat-search", Input)
        assert app.screen.focused is search and search.value == "slash"


async def test_export_writes_the_chat_as_markdown(make_app, tmp_path):
    app = make_app(ScriptedModel())
    target = tmp_path / "out" / "chat.md"
    target.parent.mkdir()
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "Explain the delta rule")
        await pilot.press("ctrl+x")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputDialog))
        assert app.screen.query_one("#dialog-input").value.endswith("explain-the-delta-rule.md")
        app.screen.query_one("#dialog-input").value = str(target)
        await pilot.press("enter")
        await pilot.pause()
    text = target.read_text()
    assert text.startswith("# Explain the delta rule")
    assert "## You" in text and "## Assistant" in text and "```python" in text
    assert "<details>" in text  # the reasoning, folded


async def test_chat_list_selection_opens_a_chat(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "older chat")
        await pilot.press("ctrl+n")
        await send(pilot, "newer chat")
        chat_list = screen.query_one(ChatList)
        rows = chat_list.query_one(ChatRows)
        assert "newer chat" in str(rows.get_option_at_index(0).prompt)  # newest first
        rows.focus()
        rows.highlighted = 1
        await pilot.press("enter")
        await pilot.pause()
        assert current_chat(screen).title == "older chat"
        assert screen.query_one(UserMessage).text == "older chat"
