"""Does the app slow the engine? Decode tok/s inside the app against `cmpchat run`, same model and prompt.

    python tests/tui/speed_check.py [--model FILE] [--tokens 200] [--rounds 3] [--size 160x48]

Each round runs `cmpchat run` (greedy, no thinking) and then the app in a real terminal (tmux) with the
same prompt and settings, reading the app's figure from its history database. Rounds alternate so a
busy machine affects both sides alike; the ratio of medians is the result. Not part of the test suite
(it takes minutes); the issue's pass mark is a ratio of at least 0.95.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Tell me a story about a GPU"
RUN_SPEED = re.compile(r"reply: (\d+) tokens, ([\d.]+) tok/s")


def run_cli(model: str | None, tokens: int) -> float:
    command = [sys.executable, "-m", "cmpchat", "run", "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--no-think"]
    if model:
        command += ["-m", model]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    match = RUN_SPEED.search(result.stderr)
    assert match, result.stderr
    return float(match.group(2))


def run_app(model: str | None, tokens: int, size: tuple[int, int]) -> float:
    home = Path(tempfile.mkdtemp(prefix="cmpchat-speed-"))
    config = home / "config" / "cmpchat" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"max_tokens = {tokens}\nthinking = false\ntemperature = 0\n")
    env = f"XDG_CONFIG_HOME={home / 'config'} XDG_DATA_HOME={home / 'data'} PYTHONPATH={REPO}"
    source = ["-m", model] if model else ["--demo"]
    app = " ".join(shlex.quote(p) for p in [sys.executable, "-m", "cmpchat", *source])
    socket = f"cmpchat-speed-{os.getpid()}"
    tmux = ["tmux", "-L", socket]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "s", "-x", str(size[0]), "-y", str(size[1]), f"env {env} {app}"], check=True
    )
    try:
        _wait(lambda: "· CPU" in _screen(tmux) or " GPU" in (_screen(tmux).splitlines() or [""])[0], 300)
        subprocess.run([*tmux, "send-keys", "-t", "s", "-l", PROMPT], check=True)
        time.sleep(0.3)
        subprocess.run([*tmux, "send-keys", "-t", "s", "Enter"], check=True)
        database = home / "data" / "cmpchat" / "history.sqlite3"
        _wait(lambda: _finished_speed(database) is not None, 600)
        return _finished_speed(database) or 0.0
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def _screen(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "s"], capture_output=True, text=True).stdout


def _finished_speed(database: Path) -> float | None:
    if not database.exists():
        return None
    import json

    with sqlite3.connect(database) as db:
        row = db.execute("SELECT stats FROM messages WHERE role='assistant' AND status='complete'").fetchone()
    return json.loads(row[0])["decode_tokens_per_second"] if row else None


def _wait(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="GGUF file (default: the demo model)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="160x48")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    cli, app = [], []
    for round_ in range(args.rounds):
        cli.append(run_cli(args.model, args.tokens))
        app.append(run_app(args.model, args.tokens, size))  # type: ignore[arg-type]
        print(f"round {round_ + 1}: cmpchat run {cli[-1]:.1f} tok/s, app {app[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(app) / statistics.median(cli)
    print(
        f"median: cmpchat run {statistics.median(cli):.1f} tok/s, app {statistics.median(app):.1f} tok/s, ratio {ratio:.3f}"
    )
    print(f"best:   cmpchat run {max(cli):.1f} tok/s, app {max(app):.1f} tok/s, ratio {max(app) / max(cli):.3f}")


if __name__ == "__main__":
    main()
