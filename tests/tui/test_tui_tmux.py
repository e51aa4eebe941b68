"""Smoke tests of the real app in a real terminal: tmux runs `cmpchat chat --demo` at 80×24, the test
types a message, reads the reply and its tok/s figure off the screen, and quits; a second test kills
the app mid-reply and checks that nothing written was lost.

Needs tmux (`apt-get install -y tmux`); skipped with that reason when it is missing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmpchat.demo import demo_model_path
from cmpchat.history.store import HistoryStore

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
    pytest.mark.slow,
]

SPEED = re.compile(r"(\d+(?:\.\d+)?) tok/s · (\d+) tokens")


def app_command() -> list[str]:
    """`cmpchat` with no command, as a user starts the app."""
    return [sys.executable, "-m", "cmpchat"]


class Tmux:
    """One private tmux server (its own socket, so the app gets this test's environment)."""

    def __init__(self, home: Path) -> None:
        self.socket = f"cmpchat-test-{os.getpid()}-{time.monotonic_ns()}"
        self.home = home

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def start(self, max_tokens: int, pid_file: Path) -> None:
        env = {
            "XDG_CONFIG_HOME": str(self.home / "config"),
            "XDG_DATA_HOME": str(self.home / "data"),
            "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"],  # shared: the demo model is built once per run
            "TERM": "xterm-256color",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        }
        config = self.home / "config" / "cmpchat" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(f"max_tokens = {max_tokens}\nthinking = false\ntemperature = 0\n")
        exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
        command = " ".join(shlex.quote(part) for part in [*app_command(), "--demo", "--simulated-gpus", "2"])
        script = f"echo $$ > {shlex.quote(str(pid_file))}; export {exports}; exec {command}"
        self.tmux("new-session", "-d", "-s", "app", "-x", "80", "-y", "24", f"sh -c {shlex.quote(script)}; sleep 60")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "app")

    def keys(self, *keys: str) -> None:
        """tmux key names (Enter, C-q) or text, written to the app's terminal at once."""
        self.tmux("send-keys", "-t", "app", *keys)

    def wait(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(tmp_path):
    session = Tmux(tmp_path)
    yield session
    session.close()


def wait_until_loaded(tmux: Tmux) -> bool:
    """Wait for the demo model; return whether loading progress was seen on the way."""
    saw_progress = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        screen = tmux.screen()
        saw_progress |= "Loading the demo model" in screen or "loading" in screen
        if "demo model · CPU" in screen and "Loading the demo model" not in screen:
            return saw_progress
        time.sleep(0.2)
    raise AssertionError(f"the demo model did not load; the screen was:\n{tmux.screen()}")


def test_chat_on_the_demo_model_in_tmux(tmux, tmp_path):
    fresh = not demo_model_path().exists()
    tmux.start(max_tokens=24, pid_file=tmp_path / "pid")
    saw_progress = wait_until_loaded(tmux)
    if fresh:
        assert saw_progress, "the first start built the demo model without showing progress"
    screen = tmux.screen()
    assert "demo model, random text" in screen  # the demo banner
    tmux.keys("Hello there", "Enter")  # one write: the app reads the text and the Enter together
    screen = tmux.wait(lambda s: SPEED.search(s), 120, "the reply and its speed line")
    speed = SPEED.search(screen)
    assert speed is not None
    tokens_per_second, tokens = (float(x) for x in speed.groups())
    assert tokens_per_second > 0 and 1 <= tokens <= 24
    assert "Hello there" in screen and "you" in screen
    status_line = screen.splitlines()[-2]
    assert "tok/s" in status_line and "GPU" in status_line  # the narrow status bar
    tmux.keys("C-q")
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the app did not quit on Ctrl+Q"
    store = HistoryStore(tmp_path / "data" / "cmpchat" / "history.sqlite3")
    chat = store.chats()[0]
    user, reply = store.messages(chat.id)
    assert user.content == "Hello there" and reply.status == "complete" and reply.content


def test_killing_the_app_mid_reply_loses_nothing(tmux, tmp_path):
    tmux.start(max_tokens=4000, pid_file=tmp_path / "pid")
    wait_until_loaded(tmux)
    tmux.keys("Write a long story", "Enter")
    tmux.wait(lambda s: "generating" in s or "●" in s, 60, "the reply to start")
    time.sleep(2.0)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    store = HistoryStore(tmp_path / "data" / "cmpchat" / "history.sqlite3")
    chat = store.chats()[0]
    reply = store.messages(chat.id)[-1]
    assert reply.status == "streaming" and reply.content  # what was on screen half a second ago is on disk
    store.close()
    tmux.close()
    tmux.socket += "-again"
    tmux.start(max_tokens=24, pid_file=tmp_path / "pid2")
    wait_until_loaded(tmux)
    # The reopened chat shows the reply marked interrupted (a long reply may have scrolled the prompt away).
    tmux.wait(lambda s: "interrupted" in s, 30, "the interrupted reply")
    user, reopened = HistoryStore(tmp_path / "data" / "cmpchat" / "history.sqlite3").messages(chat.id)
    assert user.content == "Write a long story"
    assert reopened.status == "interrupted" and reopened.content.startswith(reply.content)
    tmux.keys("C-q")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone as far as the app is concerned.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_lost_terminal_ends_the_app_and_keeps_the_reply(tmux, tmp_path):
    """SIGHUP (the SSH connection or the tmux server went away) mid-reply: the app leaves at once and
    the partial reply is stored, marked interrupted."""
    tmux.start(max_tokens=4000, pid_file=tmp_path / "pid")
    wait_until_loaded(tmux)
    tmux.keys("Write a long story", "Enter")
    tmux.wait(lambda s: "generating" in s or "●" in s, 60, "the reply to start")
    time.sleep(1.5)
    pid = int((tmp_path / "pid").read_text())
    tmux.close()  # kills the server: the app's terminal is gone
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the app kept running after its terminal went away"
    store = HistoryStore(tmp_path / "data" / "cmpchat" / "history.sqlite3")
    reply = store.messages(store.chats()[0].id)[-1]
    assert reply.status == "interrupted" and reply.content
