"""Small helpers for Pilot-driven tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from textual import events
from textual.keys import _character_to_key, key_to_character
from textual.pilot import Pilot

from cmpchat.history.store import ChatRecord
from cmpchat.tui.screens.chat_screen import ChatScreen
from cmpchat.tui.widgets.prompt import PromptArea


async def wait_for(pilot: Pilot, condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until `condition()` is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.02)


def chat_screen(pilot: Pilot) -> ChatScreen:
    for screen in pilot.app.screen_stack:
        if isinstance(screen, ChatScreen):
            return screen
    raise AssertionError("no chat screen")


def current_chat(screen: ChatScreen) -> ChatRecord:
    """The stored chat the screen shows (a chat is stored with its first message)."""
    chat = screen.session.chat
    assert chat is not None, "the screen shows no stored chat"
    return chat


async def ready(pilot: Pilot) -> ChatScreen:
    """Wait until the model is loaded; return the chat screen."""
    await wait_for(pilot, lambda: pilot.app.model is not None, what="the model to load")  # type: ignore[attr-defined]
    await pilot.pause()
    return chat_screen(pilot)


async def send(pilot: Pilot, text: str, *, wait: bool = True) -> None:
    """Type `text` into the prompt, press Enter, and (by default) wait until the reply has finished."""
    screen = chat_screen(pilot)
    screen.query_one(PromptArea).focus()
    screen.query_one(PromptArea).insert(text)
    await pilot.press("enter")
    if wait:
        await wait_for(pilot, lambda: screen.active_reply is None and not screen.generating, what="the reply")
        await pilot.pause()


def read_at_once(pilot: Pilot, *keys: str) -> None:
    """Deliver `keys` (characters, or key names such as "enter") as the terminal driver does when they
    arrive in one read: all queued for the app before it handles the first. Pilot's `press` instead waits
    until each key has been handled, which no fast typist, paste of keys or `tmux send-keys` does."""
    for key in keys:
        if len(key) == 1:
            pilot.app.post_message(events.Key(_character_to_key(key), key))
        else:
            pilot.app.post_message(events.Key(key, key_to_character(key)))


def plain(widget: object) -> str:
    """What a widget shows, as plain text (markup and styles removed)."""
    from textual.content import Content

    rendered = widget.render()  # type: ignore[attr-defined]
    if isinstance(rendered, str):
        return Content.from_markup(rendered).plain
    return str(getattr(rendered, "plain", rendered))
