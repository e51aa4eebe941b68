"""Images through the app, end to end: the fixture vision model opened with its projector on the reference
backend, images attached through the picker and sent in order with the whole conversation, shown again
after a restart; and one line, before anything is sent, for a model that cannot see them (no projector, a
backend without images, a server that reads none) and for an image whose file is gone or broken."""

from __future__ import annotations

import base64
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

import cmpchat
from cmpchat.chat.messages import ImagePart, Message, TextPart
from cmpchat.cli import main
from cmpchat.gpu_readings import UnavailableSampler
from cmpchat.history.images import ImageStore
from cmpchat.history.store import HistoryStore
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.model_request import ModelRequest, model_sees_images, why_no_images
from cmpchat.tui.remote_model import RemoteModel, RemoteServer, chat_body, openai_message, reads_images
from cmpchat.tui.screens.dialogs import ConfirmDialog
from cmpchat.tui.screens.image_picker import ImagePickerScreen
from cmpchat.tui.settings import AppState, Settings
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.messages import ReplyView, UserMessage
from cmpchat.tui.widgets.prompt import AttachmentBar
from tests.tui.fakes import ScriptedModel
from tests.tui.helpers import current_chat, ready, send, wait_for
from tests.tui.openai_stub import StubScript, _Handler, chunk, openai_stub, usage_chunk
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, TEXT_F32, manifest

IMAGE = FIXTURES / manifest()["cases"]["grow_rgba"]["image"]
OTHER_IMAGE = FIXTURES / manifest()["cases"]["round_rgb"]["image"]


class Spy:
    """A real model that records the messages of each chat the app asks of it."""

    def __init__(self, model: cmpchat.Model) -> None:
        self._model = model
        self.chats: list[list[Message]] = []
        self.asked = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def chat(self, messages, *args, **kwargs):
        self.chats.append(list(messages))
        self.asked.set()
        return self._model.chat(messages, *args, **kwargs)


def spying_opener(opened: list[dict[str, Any]], spies: list[Spy]):
    """`open_model` for the app, recording what it was asked and keeping the spy it returns."""

    def opener(path, *, backend, progress, **options):
        opened.append({"path": path, "backend": backend, **options})
        spy = Spy(cmpchat.open_model(path, backend=backend, progress=progress, **options))
        spies.append(spy)
        return spy

    return opener


async def attach(pilot, path: Path) -> None:
    """As a person does: Ctrl+O, the path typed into the picker, Enter."""
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ImagePickerScreen), what="the image picker")
    picker = pilot.app.screen
    picker.query_one("#image-path").value = str(path)
    picker.query_one("#image-path").focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(pilot.app.screen, ImagePickerScreen), what="the picker to close")


def notices(app: CmpchatApp) -> list[str]:
    return [n.message for n in app._notifications]


def vision_app(make_app, request: ModelRequest, opened: list, spies: list[Spy], **kwargs) -> CmpchatApp:
    app = make_app(
        opener=spying_opener(opened, spies),
        settings=Settings(backend="cpu", max_tokens=6, temperature=0.0),
        state=AppState(thinking=False),
        **kwargs,
    )
    app.requested_model = request
    return app


@pytest.mark.asyncio
async def test_the_vision_model_reads_every_attached_image_in_order_and_history_shows_them(make_app):
    opened: list[dict[str, Any]] = []
    spies: list[Spy] = []
    app = vision_app(make_app, ModelRequest(TEXT_F32, MMPROJ_F32), opened, spies, fresh_state=False)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert opened[0]["mmproj"] == MMPROJ_F32 and opened[0]["backend"] == "cpu"
        model = spies[0]
        assert model.supports_images and model.projector_path == MMPROJ_F32
        await attach(pilot, IMAGE)
        await attach(pilot, OTHER_IMAGE)
        bar = screen.query_one(AttachmentBar)
        assert [a.name for a in bar.attachments] == [IMAGE.name, OTHER_IMAGE.name]
        assert not bar.query(".attachment-warning")  # this model sees them: no warning
        await send(pilot, "What are these?")
        chat = current_chat(screen)
        user, reply = app.history.messages(chat.id)
        assert reply.status == "complete" and reply.stats["generated_tokens"] >= 1
        stored_paths = [str(app.images.path(i)) for i in user.images]
        assert len(user.images) == 2
        sent = model.chats[0][-1]
        assert [part.ref for part in sent.images] == stored_paths  # every image, in the order attached
        assert isinstance(sent.content, list) and isinstance(sent.content[-1], TextPart)
        # The engine's prompt held both images: its pads expanded to their rows, and all of it was read.
        request = model.chat_request(model.chats[0], enable_thinking=False)
        assert request.images is not None and len(request.images.starts) == 2
        image_pad = model.tokenizer.token_to_id("<|image_pad|>")
        image_tokens = [len(model.image_encoder.encode(image).rows) for image in (IMAGE, OTHER_IMAGE)]
        assert [len(image.rows) for image in request.images.images] == image_tokens
        assert list(request.prompt).count(image_pad) == sum(image_tokens)
        text_only = model.chat_request([Message("user", "What are these?")], enable_thinking=False)
        assert reply.stats["prompt_tokens"] == len(request.prompt) >= len(text_only.prompt) + sum(image_tokens)
        encoded = model.image_encoder.encoded

        # The next turn sends the conversation again, images of the first turn included (found encoded).
        await send(pilot, "And the second one?")
        again = model.chats[1]
        assert [part.ref for part in again[0].images] == stored_paths and again[-1].images == []
        assert app.history.messages(chat.id)[-1].status == "complete"
        assert model.image_encoder.encoded == encoded
        chat_id = chat.id

    # After a restart the chat opens again with the message's images shown.
    again_app = make_app(ScriptedModel(), fresh_state=False)
    async with again_app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert current_chat(screen).id == chat_id
        shown = screen.query_one(Conversation).query(UserMessage).first()
        assert [str(p) for p in shown.images] == stored_paths and all(p.exists() for p in shown.images)
        assert len(shown.query(".thumbnail")) == 2 and not shown.query(".thumbnail-missing")


@pytest.mark.asyncio
async def test_without_a_projector_the_app_says_so_before_sending_and_keeps_the_images(make_app, tmp_path):
    alone = tmp_path / "model" / "tiny-vision.gguf"  # no mmproj file beside it
    alone.parent.mkdir()
    shutil.copy(TEXT_F32, alone)
    opened: list[dict[str, Any]] = []
    spies: list[Spy] = []
    app = vision_app(make_app, ModelRequest(alone), opened, spies)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert "mmproj" not in opened[0] and not spies[0].supports_images
        await attach(pilot, IMAGE)
        await send(pilot, "what is this?", wait=False)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), what="the no-vision warning")
        said = cast(ConfirmDialog, app.screen).message
        assert "tiny-vision.gguf has no vision projector" in said and "--mmproj FILE" in said and "\n" not in said
        assert not spies[0].chats  # told before anything is sent
        await pilot.click("#yes")
        await wait_for(pilot, lambda: spies[0].chats and not screen.generating, what="the reply")
        await pilot.pause()
        user, reply = app.history.messages(current_chat(screen).id)
        assert reply.status == "complete"
        assert len(user.images) == 1 and app.images.path(user.images[0]).exists()  # kept with the message
        assert spies[0].chats[0][-1].content == "what is this?"  # the text alone was sent

        # An image alone cannot be sent to it: one line, and the image stays attached.
        await attach(pilot, IMAGE)
        await send(pilot, "", wait=False)
        await pilot.pause()
        line = notices(app)[-1]
        assert "cannot see images: tiny-vision.gguf has no vision projector" in line and "\n" not in line
        assert len(spies[0].chats) == 1 and len(screen.query_one(AttachmentBar).attachments) == 1


@pytest.mark.asyncio
async def test_an_image_whose_file_is_gone_at_send_time_is_one_line_and_the_message_is_kept(make_app):
    opened: list[dict[str, Any]] = []
    spies: list[Spy] = []
    app = vision_app(make_app, ModelRequest(TEXT_F32, MMPROJ_F32), opened, spies)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await attach(pilot, IMAGE)
        stored = screen.query_one(AttachmentBar).attachments[0].image
        stored.path.unlink()  # deleted behind the app's back
        await send(pilot, "what is this?")
        line = notices(app)[-1]
        assert (
            line.startswith("Image 1 of your message cannot be sent: its file is gone (") and str(stored.path) in line
        )
        assert "the message is kept" in line and "\n" not in line
        assert not spies[0].chats and not screen.query(ReplyView)  # no reply was started, none failed
        (user,) = app.history.messages(current_chat(screen).id)
        assert user.content == "what is this?" and user.images == [stored.id]
        assert screen.query_one(UserMessage).query(".thumbnail-missing")

        # Put back broken: read at send time, refused the same way.
        stored.path.write_bytes(b"not a picture")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert "its file is not an image cmpchat can read" in notices(app)[-1] and not spies[0].chats

        # Put back whole: Ctrl+R sends it.
        shutil.copy(IMAGE, stored.path)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: spies[0].chats and not screen.generating, what="the reply")
        await pilot.pause()
        assert app.history.messages(current_chat(screen).id)[-1].status == "complete"
        assert [part.ref for part in spies[0].chats[0][-1].images] == [str(stored.path)]


@pytest.mark.asyncio
async def test_an_earlier_messages_lost_image_is_left_out_with_a_line(make_app):
    opened: list[dict[str, Any]] = []
    spies: list[Spy] = []
    app = vision_app(make_app, ModelRequest(TEXT_F32, MMPROJ_F32), opened, spies)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await attach(pilot, IMAGE)
        await send(pilot, "what is this?")
        app.images.path(app.history.messages(current_chat(screen).id)[0].images[0]).unlink()
        await send(pilot, "and now?")
        assert "Image 1 of an earlier message cannot be sent: its file is gone" in notices(app)[-1]
        assert [m.images for m in spies[0].chats[1] if m.role == "user"] == [[], []]
        assert app.history.messages(current_chat(screen).id)[-1].status == "complete"


def remote_app(tmp_path: Path, url: str) -> CmpchatApp:
    """The app as `cmpchat --url URL` builds it, on a private history folder."""
    return CmpchatApp(
        model_request=ModelRequest(server=RemoteServer(url)),
        settings=Settings(),
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=HistoryStore(tmp_path / "history.sqlite3"),
        images=ImageStore(tmp_path / "images"),
        gpu_sampler=UnavailableSampler("no GPUs here"),
        discover=lambda: [],
    )


@contextmanager
def vision_stub(script: StubScript) -> Iterator[str]:
    """`openai_stub` with llama-server's `GET /props` saying that it reads images."""

    class Handler(_Handler):
        def do_GET(self) -> None:
            if self.path == "/props":
                self.script.gets.append(self.path)
                self._json(200, {"modalities": {"vision": True, "audio": False}})
            else:
                super().do_GET()

    Handler.script = script
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="vision-stub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.asyncio
async def test_a_server_that_reads_images_gets_them_as_data_uris(tmp_path):
    script = StubScript(chunks=[chunk({"content": "a red square"}, "stop"), usage_chunk(90, 3)])
    with vision_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            assert model_sees_images(app.model)
            await attach(pilot, IMAGE)
            await attach(pilot, OTHER_IMAGE)
            await send(pilot, "what are these?")
            await send(pilot, "and now?")
            user, reply, *_ = app.history.messages(current_chat(screen).id)
            assert reply.status == "complete" and reply.content == "a red square"
    first, second = script.requests
    parts = first["messages"][-1]["content"]
    assert [part["type"] for part in parts] == ["image_url", "image_url", "text"]
    sent = [base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) for part in parts[:2]]
    assert sent == [IMAGE.read_bytes(), OTHER_IMAGE.read_bytes()] and parts[2]["text"] == "what are these?"
    assert second["messages"][0]["content"] == parts and second["messages"][-1]["content"] == "and now?"
    assert len(user.images) == 2


@pytest.mark.asyncio
async def test_a_server_that_reads_no_images_is_named_before_sending(tmp_path):
    script = StubScript(chunks=[chunk({"content": "text only"}, "stop"), usage_chunk(5, 2)])
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            assert "/props" in script.gets and not model_sees_images(app.model)  # the stub has no /props: a 404
            await attach(pilot, IMAGE)
            await send(pilot, "what is this?", wait=False)
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), what="the no-vision warning")
            said = cast(ConfirmDialog, app.screen).message
            assert f"the server at {RemoteServer(url).address} does not say it reads images" in said
            await pilot.click("#yes")
            await wait_for(pilot, lambda: script.requests and not screen.generating, what="the reply")
            await pilot.pause()
            assert script.requests[0]["messages"][-1]["content"] == "what is this?"
            assert len(app.history.messages(current_chat(screen).id)[0].images) == 1


def props_client(answer: httpx.Response | Exception) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/props"
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_a_server_reads_images_when_its_props_say_vision():
    server = RemoteServer("http://gpu-box:8080/v1")
    vision = {"modalities": {"vision": True, "audio": False}}
    assert reads_images(server, props_client(httpx.Response(200, json=vision)))
    assert not reads_images(server, props_client(httpx.Response(200, json={"modalities": {"vision": False}})))
    assert not reads_images(server, props_client(httpx.Response(200, json={"default_generation_settings": {}})))
    assert not reads_images(server, props_client(httpx.Response(404, json={"error": "not found"})))
    assert not reads_images(server, props_client(httpx.Response(200, text="<html>")))
    assert not reads_images(server, props_client(httpx.ConnectError("refused")))


def test_images_go_to_a_server_as_data_uris_in_order(tmp_path):
    jpeg = tmp_path / "ab" / "photo.jpg"
    jpeg.parent.mkdir()
    jpeg.write_bytes(b"\xff\xd8jpeg bytes")
    message = Message("user", [ImagePart(str(IMAGE)), ImagePart(str(jpeg)), TextPart("Same?")])
    body = chat_body("m", [message], cmpchat.GenerationOptions(), None)
    first, second, text = body["messages"][0]["content"]
    assert first["type"] == "image_url" and first["image_url"]["url"].startswith("data:image/png;base64,")
    assert base64.b64decode(first["image_url"]["url"].split(",", 1)[1]) == IMAGE.read_bytes()
    assert second["image_url"]["url"] == "data:image/jpeg;base64," + base64.b64encode(jpeg.read_bytes()).decode()
    assert text == {"type": "text", "text": "Same?"}
    assert openai_message(message, with_images=False)["content"] == "Same?"  # for /apply-template
    with pytest.raises(cmpchat.CmpchatError, match="gone.png could not be read"):
        openai_message(Message("user", [ImagePart(str(tmp_path / "gone.png"))]))


def test_why_a_model_cannot_see_images_is_one_line_naming_the_fix():
    assert why_no_images(None) is None
    assert why_no_images(SimpleNamespace(supports_images=True)) is None
    bare = SimpleNamespace(supports_images=False, path=Path("q.gguf"), is_demo=False, projector_path=None)
    assert (
        why_no_images(bare) == "q.gguf has no vision projector (put its mmproj file beside it, or give --mmproj FILE)"
    )
    no_reader = SimpleNamespace(
        supports_images=False, path=Path("q.gguf"), is_demo=False, projector_path=MMPROJ_F32,
        backend=SimpleNamespace(name="scripted"),
    )  # fmt: skip
    assert why_no_images(no_reader) == "the scripted backend does not read images"
    assert (
        why_no_images(SimpleNamespace(supports_images=False, is_demo=True)) == "the demo model has no vision projector"
    )
    remote = RemoteModel(RemoteServer("http://gpu-box:8080/v1"), "m", client=httpx.Client())
    assert why_no_images(remote) == "the server at gpu-box:8080 does not say it reads images, so the app sends it none"


def test_the_app_takes_mmproj_with_a_model(tmp_path, monkeypatch, capsys):
    started: list[ModelRequest | None] = []

    def run(self: CmpchatApp) -> None:  # instead of taking over the terminal
        started.append(self.requested_model)
        self.history.close()

    monkeypatch.setattr(CmpchatApp, "run", run)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert main(["-m", str(TEXT_F32), "--mmproj", str(MMPROJ_F32)]) == 0
    assert started == [ModelRequest(TEXT_F32, MMPROJ_F32)]
    assert main(["--mmproj", str(MMPROJ_F32)]) == 1
    assert "--mmproj goes with -m" in capsys.readouterr().err
    assert main(["-m", str(TEXT_F32), "--mmproj", str(tmp_path / "none.gguf")]) == 1
    assert "none.gguf: no such file" in capsys.readouterr().err


def test_a_stored_image_that_no_longer_reads_shows_a_line_not_a_crash(tmp_path) -> None:
    from textual.widgets import Static

    from cmpchat.tui.widgets.messages import _thumbnail

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a picture any more")
    shown = _thumbnail(broken)
    assert isinstance(shown, Static) and "image unreadable: broken.png" in str(shown.render())
    gone = _thumbnail(tmp_path / "gone.png")
    assert isinstance(gone, Static) and "image missing: gone.png" in str(gone.render())
