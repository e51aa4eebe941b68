"""The app around the chat: themes, keys and help, model choice and loading, narrow-screen overlays,
and the real engine on the tiny model."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
from textual.command import CommandList, CommandPalette
from textual.geometry import Region
from textual.widgets import OptionList
from textual.widgets._toast import Toast

from cmpchat.api import open_model
from cmpchat.model.discovery import FoundModel
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.model_request import ModelRequest
from cmpchat.tui.screens.dialogs import TextInputDialog
from cmpchat.tui.screens.help import HelpScreen
from cmpchat.tui.screens.model_picker import ModelPickerScreen
from cmpchat.tui.screens.overlays import ChatListScreen, GpuScreen
from cmpchat.tui.settings import AppState, Settings
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from cmpchat.tui.widgets.load_progress import LoadProgress
from cmpchat.tui.widgets.messages import ReplyView
from cmpchat.tui.widgets.prompt import PromptArea
from cmpchat.tui.widgets.status_bar import StatusBar
from cmpchat.tui.widgets.title_bar import DemoBanner, TitleBar
from tests.tui.fakes import ScriptedModel, scripted_opener
from tests.tui.helpers import chat_screen, current_chat, plain, ready, send, wait_for

pytestmark = pytest.mark.asyncio


async def test_theme_from_the_command_palette_is_remembered(make_app):
    app = make_app(ScriptedModel(), fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        assert app.theme == "cmpchat-dark"
        assert {"cmpchat-dark", "cmpchat-light", "terminal"} <= set(app.available_themes)
        await pilot.press("ctrl+p")
        await pilot.press(*"theme")
        await pilot.pause(0.3)
        await pilot.press("enter")  # "Theme: change the current theme"
        await pilot.pause(0.3)
        await pilot.press(*"cmpchat-light")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.theme == "cmpchat-light", what="the theme to change")
    again = make_app(ScriptedModel(), fresh_state=False)
    async with again.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        assert again.theme == "cmpchat-light"


@pytest.mark.parametrize("theme", ["cmpchat-dark", "cmpchat-light", "terminal"])
async def test_every_shipped_theme_renders(make_app, theme):
    app = make_app(ScriptedModel(), settings=Settings(theme=theme))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        assert app.theme == theme
        assert app.current_theme.ansi is (theme == "terminal")


async def run_from_palette(pilot, search: str, title: str) -> None:
    """Open the command palette, search, check that the first command found is `title`, and run it."""
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    await pilot.press(*search)
    options = pilot.app.screen.query_one(CommandList)
    await wait_for(pilot, lambda: options.option_count, what=f"commands matching {search!r}")
    await pilot.pause(0.3)
    first = options.get_option_at_index(0).prompt
    assert title in str(getattr(first, "plain", first)), f"{search!r} found {first!r} first"
    await pilot.press("down", "enter")  # the first found is highlighted with down, then run


async def test_the_palette_has_the_chat_actions(make_app):
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hello")
        await run_from_palette(pilot, "export", "Export this chat to Markdown")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputDialog), what="the export dialog")
        await pilot.press("escape")
        await run_from_palette(pilot, "new chat", "Start a new chat")
        await wait_for(pilot, lambda: screen.session.chat is None, what="a new chat")
        await run_from_palette(pilot, "all keys", "All keys")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the key list")


async def test_the_palette_screenshot_is_saved_or_says_why_not(make_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(ScriptedModel())
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await run_from_palette(pilot, "screenshot", "Screenshot")
        await wait_for(pilot, lambda: list(tmp_path.glob("*.svg")), what="the screenshot")
        await wait_for(pilot, lambda: any("Saved" in n.message for n in app._notifications), what="the notice")
        gone = tmp_path / "gone"
        gone.mkdir()
        monkeypatch.chdir(gone)
        gone.rmdir()  # the folder the app was started in no longer exists
        await run_from_palette(pilot, "screenshot", "Screenshot")
        await wait_for(
            pilot,
            lambda: any("Could not save it: No such file" in n.message for n in app._notifications),
            what="the reason",
        )


async def test_help_lists_bindings_with_their_ids_and_the_keymap_remaps_them(make_app, tmp_path):
    settings = Settings(keymap={"chat.export": "f10"})
    app = make_app(ScriptedModel(), settings=settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        rows = app.screen.rows
        ids = {row[2] for row in rows}
        assert {"chat.stop", "chat.regenerate", "chat.edit_last", "chat.thinking", "chat.attach_image"} <= ids
        assert {"prompt.send", "prompt.newline", "app.quit", "chats.rename"} <= ids
        assert ("F10", "Export this chat to Markdown", "chat.export") in rows
        await pilot.press("escape")
        await send(pilot, "hello")
        await pilot.press("f10")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputDialog), what="export via the remapped key")


async def test_model_picker_lists_found_models_and_loads_the_choice(make_app, tmp_path):
    found = [
        FoundModel(tmp_path / "Qwen3.5-9B-Q8_0.gguf", 9 * 2**30, "Hugging Face cache", "Qwen3.5 9B", "qwen35"),
        FoundModel(tmp_path / "llama.gguf", 2**30, "~/models", "Llama", "llama"),
    ]
    opened: list[tuple[Path | None, dict]] = []
    model = ScriptedModel()

    def opener(path, *, backend, progress, **options):
        opened.append((path, options))
        return model

    app = CmpchatApp(
        settings=Settings(),
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=None,
        discover=lambda: found,
        opener=opener,
        load_options={"gpus": [0, 0], "context": 8192},  # the command line's: every model opened gets them
        gpu_sampler=None,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the picker")
        picker = app.screen
        await wait_for(pilot, lambda: picker.query_one("#model-list", OptionList).option_count == 3)
        options = picker.query_one("#model-list", OptionList)
        assert options.get_option_at_index(1).disabled  # llama: not a model cmpchat runs
        assert "demo model" in str(options.get_option_at_index(2).prompt)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.model is model)
    assert opened == [(found[0].path, {"gpus": [0, 0], "context": 8192})]
    assert app.app_state.last_model == str(found[0].path)


async def test_a_loaded_model_is_kept_out_of_collections_and_freed_when_replaced(make_app, tmp_path):
    first, second = ScriptedModel(), ScriptedModel(path=tmp_path / "second.gguf")
    first.held = first  # only the cycle collector can free it, and only while it is not frozen
    to_open = [first, second]
    app = make_app(model_path=first.path)
    app.opener = lambda path, *, backend, progress: to_open.pop(0)
    first_alive = weakref.ref(first)
    del first
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert gc.get_freeze_count() > 0  # a full collection would have walked the model for nothing
        app.load_model(ModelRequest(second.path))
        await wait_for(pilot, lambda: app.model is second, what="the second model")
        assert first_alive() is None


async def test_nothing_found_opens_the_demo_model_with_its_banner(make_app, tmp_path):
    demo = ScriptedModel(is_demo=True)
    app = CmpchatApp(
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=None,
        discover=lambda: [],
        opener=scripted_opener(lambda path: demo),
    )
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await ready(pilot)
        assert screen.query_one(DemoBanner).display
        assert screen.query_one(TitleBar).model_name == "demo model"
    assert app.app_state.last_model == ""


async def test_at_80_by_24_the_demo_banner_is_one_line_and_notices_leave_the_prompt_free(tmp_path):
    demo = ScriptedModel(is_demo=True)
    app = CmpchatApp(
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=None,
        discover=lambda: [],
        opener=scripted_opener(lambda path: demo),
    )
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        screen = await ready(pilot)
        banner = screen.query_one(DemoBanner)
        assert banner.region.height == 1
        (line,) = banner.render_lines(Region(0, 0, banner.size.width, 1))
        # The whole line fits 80 columns: what to do about it too, not only that it is the demo.
        assert line.text.strip() == "demo model, random text: F4 or cmpchat -m FILE.gguf loads a real model"
        assert not app._notifications  # the banner says what the demo model is: no notice repeats it
        app.notify("A notice long enough to wrap over two lines of its box, as most of them do.", timeout=30)
        await wait_for(pilot, lambda: app.screen.query(Toast), what="the notice")
        await pilot.pause()
        prompt = screen.query_one(PromptArea).region
        toast = app.screen.query_one(Toast).region
        assert toast.height >= 3 and not toast.overlaps(prompt)


async def test_the_last_model_is_opened_again(make_app, tmp_path):
    model_file = tmp_path / "last.gguf"
    model_file.write_bytes(b"GGUF")
    opened: list[Path | None] = []

    def remember(path: Path | None) -> ScriptedModel:
        opened.append(path)
        return ScriptedModel()

    app = CmpchatApp(
        state=AppState(last_model=str(model_file)),
        state_file=tmp_path / "state.json",
        history=None,
        discover=lambda: pytest.fail("no discovery when a model is remembered"),
        opener=scripted_opener(remember),
    )
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
    assert opened == [model_file]


async def test_loading_shows_progress_and_a_failure_reopens_the_picker(make_app, tmp_path):
    release = threading.Event()

    def slow_opener(path, *, backend, progress, **options):
        progress("writing the demo model", 3, 10)
        release.wait(5)
        raise OSError("disk on fire")

    app = CmpchatApp(
        model_request=ModelRequest(None),
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=None,
        discover=lambda: [],
        opener=slow_opener,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        screen = chat_screen(pilot)
        progress = screen.query_one(LoadProgress)
        await wait_for(pilot, lambda: "writing the demo model" in str(progress.query_one("#load-title").render()))
        assert progress.display and screen.speed.phase == "loading"
        assert screen.speed.load_fraction == pytest.approx(0.3)
        release.set()
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen), what="the picker after the failure")
        # The notice is posted beside the picker; on a loaded machine it can land a frame later.
        await wait_for(pilot, lambda: any("disk on fire" in n.message for n in app._notifications), what="the notice")


async def test_narrow_screen_has_a_status_bar_and_overlays(make_app):
    app = make_app(ScriptedModel(), gpus=8)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "hi")
        assert not screen.query_one("#sidebar").display or not screen.query_one("#sidebar").region
        assert screen.query_one(StatusBar).region.height == 1
        await wait_for(pilot, lambda: len(app.gpu_readings) == 8)
        bar = plain(screen.query_one(StatusBar))
        assert "27.4 tok/s" in bar and "GPU " in bar and "ctx 18K/256K" in bar
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, GpuScreen))
        panel = app.screen.query_one(GpuPanel)
        await pilot.pause()
        first_header, second_header, *lines = plain(panel).splitlines()
        assert "memory" in first_header and "PCIe" in second_header
        assert len(lines) == 2 * 8 and all("Gen1x1" in line for line in lines[1::2])  # two lines per GPU
        await pilot.press("escape")
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen))
        await pilot.press("escape")


async def test_real_engine_on_the_tiny_model(make_app, tiny_model_path):
    app = make_app(
        model_path=tiny_model_path, settings=Settings(max_tokens=12, temperature=0), state=AppState(thinking=False)
    )
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert screen.query_one(TitleBar).model_name == "tiny.gguf"
        await send(pilot, "Hello")
        reply = screen.query_one(ReplyView)
        stored = app.history.messages(current_chat(screen).id)[-1]
        assert stored.status == "complete" and stored.stats["generated_tokens"] >= 1
        assert stored.stats["decode_tokens_per_second"] > 0
        assert "tok/s" in str(reply.stats_line.render())
        assert screen.speed.context_used > 0


class Slowed:
    """A real model whose reply events are spaced out, so a reply is surely still running when Esc comes."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def chat(self, *args, **kwargs):
        for event in self._model.chat(*args, **kwargs):
            time.sleep(0.02)  # the tiny model ends its greedy reply after ~520 tokens: keep it running >10 s
            yield event


async def test_real_engine_stops_on_escape(make_app, tiny_model_path):
    real = open_model(tiny_model_path)
    app = make_app(
        model_path=tiny_model_path, settings=Settings(max_tokens=4000, temperature=0), state=AppState(thinking=False)
    )
    app.opener = lambda path, *, backend, progress: Slowed(real)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await send(pilot, "Hello", wait=False)
        await wait_for(pilot, lambda: screen.speed.generated > 0, what="tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.generating, timeout=3, what="the stop")
        stored = app.history.messages(current_chat(screen).id)[-1]
        assert stored.status == "stopped", stored.stats
        assert 0 < stored.stats["generated_tokens"] < 4000
