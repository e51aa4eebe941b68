"""Remote mode (`cmpchat --url`), through Textual's Pilot: the app against a live `cmpchat serve` on
loopback (the scripted backend, so every word is known) and against a third-party-style OpenAI stub
(reasoning_content and usage, no timings): round trip, streaming, reasoning, the speed panel, history,
and one clear line for an unreachable server, a 401 and a stream cut mid-reply."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from cmpchat.chat.messages import Message
from cmpchat.gpu_readings import UnavailableSampler
from cmpchat.history.images import ImageStore
from cmpchat.history.store import HistoryStore
from cmpchat.server.settings import ServerSettings
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.model_request import ModelRequest
from cmpchat.tui.remote_model import RemoteModel, RemoteServer, connect
from cmpchat.tui.settings import AppState, Settings
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from cmpchat.tui.widgets.messages import ReasoningBlock, ReplyView, ToolCallView
from cmpchat.tui.widgets.speed_panel import SpeedPanel
from cmpchat.tui.widgets.title_bar import TitleBar
from tests.server.conftest import scripted_model
from tests.server.live import LiveServer, live_server
from tests.tui.helpers import chat_screen, current_chat, plain, ready, send, wait_for
from tests.tui.openai_stub import StubScript, chunk, openai_stub, usage_chunk

SERVER_KEY = "remote-test-key"


@pytest.fixture(scope="module")
def cmpchat_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path)
    settings = ServerSettings(port=0, slots=2, model_name="scripted", api_key=SERVER_KEY)
    with live_server(settings, lambda: model) as server:
        yield server


def remote_app(tmp_path: Path, url: str, api_key: str | None = None, state: AppState | None = None) -> CmpchatApp:
    """The app as `cmpchat --url URL [--api-key KEY]` builds it, on a private history folder."""
    return CmpchatApp(
        model_request=ModelRequest(server=RemoteServer(url, api_key)),
        settings=Settings(),
        state=state or AppState(),
        state_file=tmp_path / "state.json",
        history=HistoryStore(tmp_path / "history.sqlite3"),
        images=ImageStore(tmp_path / "images"),
        gpu_sampler=UnavailableSampler("no GPUs on this test machine"),  # the panel shows the server's
        discover=lambda: [],
    )


def notices(app: CmpchatApp) -> list[str]:
    return [n.message for n in app._notifications]


def stored(app: CmpchatApp) -> list[tuple[str, str, str]]:
    """(role, status, content) of every message of the chat on screen."""
    screen = app.screen_stack[0]
    chat = current_chat(screen)  # type: ignore[arg-type]
    return [(m.role, m.status, m.content) for m in app.history.messages(chat.id)]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


pytestmark = pytest.mark.asyncio


async def test_a_reply_from_cmpchat_serve_streams_with_its_reasoning_timings_and_history(tmp_path, cmpchat_server):
    app = remote_app(tmp_path, cmpchat_server.api, SERVER_KEY)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        title = screen.query_one(TitleBar)
        assert title.model_name == "scripted" and title.device == cmpchat_server.url.removeprefix("http://")
        await wait_for(pilot, lambda: "no GPU readings in these tests" in plain(screen.query_one(GpuPanel)))
        await send(pilot, "SAY:Weighing it up.</think>Hello from the server.")
        reply = screen.query_one(ReplyView)
        assert reply.content == "Hello from the server."
        assert screen.query_one(ReasoningBlock).text == "Weighing it up."
        stats = screen.query_one(SpeedPanel).stats
        assert stats.phase == "idle" and (stats.decode_rate or 0) > 0 and (stats.prompt_rate or 0) > 0
        assert stats.generated > 0 and title.context_used > stats.generated
        messages = app.history.messages(current_chat(screen).id)
        assert [(m.role, m.status) for m in messages] == [("user", "complete"), ("assistant", "complete")]
        assert messages[1].reasoning == "Weighing it up." and messages[1].model == "scripted"
        assert messages[1].stats["generated_tokens"] == stats.generated


async def test_the_context_count_comes_from_the_servers_template_and_tokenizer(cmpchat_server):
    model = connect(RemoteServer(cmpchat_server.api, SERVER_KEY))
    assert isinstance(model, RemoteModel) and model.context_length > 0
    rendered = model.render([Message("user", "hello there")], enable_thinking=True)
    assert "hello there" in rendered.text and rendered.thinking
    assert len(model.tokenize(rendered.text, parse_special=True)) > 3


async def test_a_third_party_stream_shows_reasoning_then_the_answer_and_fills_the_speed_panel(tmp_path):
    script = StubScript(
        chunks=[
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "Short question, "}),
            chunk({"reasoning_content": "short answer."}),
            chunk({"content": "Forty"}),
            chunk({"content": "-two."}, finish="stop"),
            usage_chunk(prompt=31, completion=9),
        ],
        api_key="stub-key",
        hold_after=3,
    )
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url, "stub-key")
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await ready(pilot)
            await send(pilot, "What is six times seven?", wait=False)
            # The stub holds the answer: the reasoning must already be on screen, streamed.
            await wait_for(pilot, lambda: screen.query(ReasoningBlock), what="the streamed reasoning")
            await wait_for(pilot, lambda: screen.query_one(ReasoningBlock).text == "Short question, short answer.")
            assert screen.generating and screen.query_one(ReplyView).content == ""
            script.gate.set()
            await wait_for(pilot, lambda: not screen.generating, what="the reply")
            assert screen.query_one(ReplyView).content == "Forty-two."
            stats = screen.query_one(SpeedPanel).stats
            assert stats.generated == 9 and (stats.decode_rate or 0) > 0 and stats.first_token_seconds
            assert screen.query_one(TitleBar).context_used == 31 + 9
            assert stored(app) == [
                ("user", "complete", "What is six times seven?"),
                ("assistant", "complete", "Forty-two."),
            ]
    request = script.requests[0]
    assert request["authorization"] == "Bearer stub-key" and request["model"] == "stub-model"
    assert request["stream"] and request["stream_options"] == {"include_usage": True}
    assert request["chat_template_kwargs"] == {"enable_thinking": True}
    assert request["messages"][-1] == {"role": "user", "content": "What is six times seven?"}


async def test_reasoning_sent_inline_as_think_tags_is_split_from_the_answer(tmp_path):
    pieces = ["<thi", "nk>Pondering", " it.</th", "ink>\n\nThe answer", " is <b>bold</b>."]
    script = StubScript(chunks=[chunk({"content": piece}) for piece in pieces] + [chunk({}, finish="stop")])
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            await send(pilot, "Think, then answer")
            assert screen.query_one(ReasoningBlock).text == "Pondering it."
            assert screen.query_one(ReplyView).content == "The answer is <b>bold</b>."


async def test_an_unreachable_server_says_so_and_keeps_the_message_waiting(tmp_path):
    url = closed_port_url()
    app = remote_app(tmp_path, url)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any("cannot reach the server" in n for n in notices(app)), what="the error")
        assert any(url in n and "connection failed" in n for n in notices(app))
        assert app.model is None and not any(s.__class__.__name__ == "ModelPickerScreen" for s in app.screen_stack)
        screen = chat_screen(pilot)
        assert screen.query_one(SpeedPanel).stats.phase == "error"
        await send(pilot, "Are you there?", wait=False)
        await wait_for(pilot, lambda: screen.session.chat is not None, what="the message to be stored")
        assert stored(app) == [("user", "complete", "Are you there?")]


async def test_a_server_gone_after_connecting_fails_the_reply_in_one_line_and_keeps_the_message(tmp_path):
    with ExitStack() as running:
        url = running.enter_context(openai_stub(StubScript()))
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            running.close()  # the stub stops: nothing listens at the address any more
            await send(pilot, "Hello?")
            line = plain(screen.query_one(ReplyView).stats_line)
            assert line.startswith("cannot reach the server at " + url) and "\n" not in line
            assert stored(app) == [("user", "complete", "Hello?"), ("assistant", "error", "")]


async def test_a_wrong_key_is_one_line_at_connect_and_at_send(tmp_path):
    script = StubScript(api_key="right-key")
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url, "wrong-key")
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: any("401" in n for n in notices(app)), what="the 401")
            assert any("--api-key" in n and "Incorrect API key provided" in n for n in notices(app))
        app = remote_app(tmp_path, url, "right-key")
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            script.api_key = "a-new-key"  # the server's key changed after the app connected
            await send(pilot, "Still there?")
            line = plain(screen.query_one(ReplyView).stats_line)
            assert "401" in line and "Incorrect API key provided" in line
            assert stored(app) == [("user", "complete", "Still there?"), ("assistant", "error", "")]


async def test_a_stream_cut_mid_reply_keeps_the_text_as_interrupted(tmp_path):
    script = StubScript(chunks=[chunk({"reasoning_content": "Counting."}), chunk({"content": "One, two, "})], cut=True)
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            await send(pilot, "Count to ten")
            reply = screen.query_one(ReplyView)
            assert reply.content == "One, two, "
            assert "broke off" in plain(reply.stats_line)
            assert any("broke off" in n for n in notices(app))
            assert stored(app) == [("user", "complete", "Count to ten"), ("assistant", "interrupted", "One, two, ")]
            assert len(screen.query_one(Conversation).children) == 2
            chat_id = current_chat(screen).id
        again = remote_app(tmp_path, url, state=AppState(last_chat=chat_id))
        async with again.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            reply = screen.query_one(ReplyView)
            assert reply.content == "One, two, " and "the server's stream broke" in plain(reply.stats_line)


async def test_esc_stops_at_once_while_the_server_says_nothing(tmp_path):
    # A long prompt on a slow card: minutes may pass before the first chunk; Esc must not wait for it.
    script = StubScript(chunks=[chunk({"content": "late"})], hold_after=0)
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            await send(pilot, "A very long prompt", wait=False)
            await wait_for(pilot, lambda: script.requests, what="the request to reach the server")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.generating, timeout=2, what="the reply to stop")
            assert stored(app) == [("user", "complete", "A very long prompt"), ("assistant", "stopped", "")]


async def test_a_streamed_tool_call_is_shown_and_stored(tmp_path):
    call = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "weather", "arguments": ""}}
    script = StubScript(
        chunks=[
            chunk({"content": "Let me look."}),
            chunk({"tool_calls": [call]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}, finish="tool_calls"),
        ]
    )
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot)
            await send(pilot, "Weather in Oslo?")
            row = screen.query_one(ToolCallView)
            assert row.title == 'tool call · weather({"city": "Oslo"})'
            reply = app.history.messages(current_chat(screen).id)[-1]
            assert reply.tool_calls == [{"name": "weather", "arguments": {"city": "Oslo"}, "id": "call_7"}]
