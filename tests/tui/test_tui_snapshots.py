"""Snapshots of the main screens at 80×24 and 160×48 (pytest-textual-snapshot).

Everything that moves by itself is pinned first: GPU readings come from a fresh fake sampler pushed a
fixed number of times, the decode sparkline gets fixed samples, the reasoning time is fixed, the
cursor does not blink and notifications are cleared. Update with `--snapshot-update`, and look at
every changed SVG (tests/tui/__snapshots__/) before committing it.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from cmpchat.gpu_readings import FakeGpuSampler, GpuStage
from cmpchat.model.discovery import FoundModel
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.reply_run import ReplyRun
from cmpchat.tui.settings import AppState, Settings
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.fakes import ScriptedModel, scripted_opener
from tests.tui.helpers import chat_screen, ready, send, wait_for

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 48), id="160x48")]
SPARK = (22.0, 25.1, 26.8, 27.3, 27.9, 27.2, 27.6, 27.4, 27.5, 27.1, 27.8, 27.4)
PIPELINE = tuple(GpuStage(i, None, i, range(i * 22, min(64, (i + 1) * 22)), "decode") for i in range(3))
"""27B's 64 layers as three stages on GPUs 0 to 2 (`--gpus 0,1,2 --split 22,22,20`), decoding."""


@pytest.fixture(autouse=True)
def fixed_reasoning_time(monkeypatch):
    monkeypatch.setattr(ReplyRun, "reasoning_seconds", property(lambda self: 3.1))


async def pin(pilot, gpus: int = 4, stages: tuple[GpuStage, ...] = ()) -> None:
    """Freeze what changes with time: GPU readings and history, sparkline, cursor, notifications; `stages`
    are the model's pipeline stages on the GPUs."""
    app = pilot.app
    if app._gpu_monitor is not None:
        app._gpu_monitor.stop()
    app._gpu_monitor = None
    await pilot.pause()
    sampler = FakeGpuSampler(gpus)
    for screen in app.screen_stack:
        for panel in screen.query(GpuPanel):
            panel.reset_history()
    app.gpu_stages = stages
    for _ in range(12):
        app.gpu_readings = tuple(sampler.read())
        await pilot.pause()
    screen = chat_screen(pilot)
    first_token = 1.42 if screen.speed.first_token_seconds is not None else None
    screen.speed = replace(screen.speed, decode_history=SPARK, first_token_seconds=first_token)
    screen.query_one(PromptArea).cursor_blink = False
    app.clear_notifications()
    await pilot.pause()


def chat_app(make_app, **kwargs) -> CmpchatApp:
    return make_app(ScriptedModel(), **kwargs)


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_after_a_reply(snap_compare, make_app, size):
    async def run_before(pilot):
        await ready(pilot)
        await send(pilot, "Explain the delta rule in two sentences.")
        await pin(pilot)

    assert snap_compare(chat_app(make_app), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_while_a_reply_streams(snap_compare, make_app, size):
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate))

    async def run_before(pilot):
        screen = await ready(pilot)
        await send(pilot, "Explain the delta rule in two sentences.", wait=False)
        await wait_for(pilot, lambda: screen.speed.generated, what="the first tokens")
        await pilot.pause(0.1)
        await pin(pilot)

    try:
        assert snap_compare(app, terminal_size=size, run_before=run_before)
    finally:
        gate.set()


@pytest.mark.parametrize("size", SIZES)
def test_first_start_on_the_demo_model(snap_compare, make_app, size):
    async def run_before(pilot):
        await ready(pilot)
        await pin(pilot, gpus=0)
        pilot.app.gpu_problem = "no NVIDIA driver (NVML not found)"
        await pilot.pause()

    assert snap_compare(make_app(ScriptedModel(is_demo=True)), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_help_screen(snap_compare, make_app, size, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", "/home/you/.config")  # the help names the config file

    async def run_before(pilot):
        await ready(pilot)
        await pin(pilot)
        await pilot.press("f1")

    assert snap_compare(chat_app(make_app), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_chat_settings_dialog(snap_compare, make_app, size):
    async def run_before(pilot):
        await ready(pilot)
        await pin(pilot)
        await pilot.press("ctrl+s")

    assert snap_compare(chat_app(make_app), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_gpu_overlay_with_eight_gpus(snap_compare, make_app, size):
    """Two lines a GPU at 80 columns, one at 160; the stages on GPUs 0 to 2, none on the rest."""

    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f3")
        await pilot.pause()
        await pin(pilot, gpus=8, stages=PIPELINE)

    assert snap_compare(chat_app(make_app, gpus=8), terminal_size=size, run_before=run_before)


def test_side_panel_with_a_pipeline(snap_compare, make_app):
    """The side column's stage line under each GPU that holds a stage, while a reply streams."""
    gate = threading.Event()
    app = make_app(ScriptedModel(gate=gate), gpus=4)

    async def run_before(pilot):
        screen = await ready(pilot)
        await send(pilot, "Explain the delta rule in two sentences.", wait=False)
        await wait_for(pilot, lambda: screen.speed.generated, what="the first tokens")
        await pilot.pause(0.1)
        await pin(pilot, stages=PIPELINE)

    try:
        assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)
    finally:
        gate.set()


@pytest.mark.parametrize("size", SIZES)
def test_model_picker(snap_compare, tmp_path, size):
    found = [
        FoundModel(
            Path("/root/models/Qwen3.6-27B-Q8_0.gguf"),
            28 * 2**30,
            "~/models",
            "Qwen3.6 27B",
            "qwen35",
            Path("/root/models/mmproj-Qwen3.6-27B-F16.gguf"),
        ),
        FoundModel(
            Path("/root/.cache/llama.cpp/Qwen3.5-9B-Q8_0.gguf"), 9 * 2**30, "llama.cpp cache", "Qwen3.5 9B", "qwen35"
        ),
        FoundModel(Path("/root/models/Llama-3-8B.gguf"), 8 * 2**30, "~/models", "Llama 3 8B", "llama"),
    ]
    app = CmpchatApp(
        settings=Settings(),
        state=AppState(),
        state_file=tmp_path / "state.json",
        history=None,
        gpu_sampler=FakeGpuSampler(0),
        discover=lambda: found,
        opener=scripted_opener(lambda path: ScriptedModel()),
    )

    async def run_before(pilot):
        await wait_for(
            pilot,
            lambda: pilot.app.screen.query("#model-list") and pilot.app.screen.query_one("#model-list").option_count,
        )
        screen = chat_screen(pilot)
        screen.query_one(PromptArea).cursor_blink = False
        pilot.app.clear_notifications()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_light_theme(snap_compare, make_app):
    async def run_before(pilot):
        await ready(pilot)
        await send(pilot, "Explain the delta rule in two sentences.")
        await pin(pilot)

    app = chat_app(make_app, settings=Settings(theme="cmpchat-light"))
    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)


def test_terminal_theme(snap_compare, make_app):
    async def run_before(pilot):
        await ready(pilot)
        await send(pilot, "Explain the delta rule in two sentences.")
        await pin(pilot)

    app = chat_app(make_app, settings=Settings(theme="terminal"))
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
