"""Does the app slow the engine? Decode tok/s inside the app against `cmpchat run`, same model and prompt.

    python tests/tui/speed_check.py [--model FILE] [--tokens 200] [--rounds 3] [--size 160x48]

Each round runs `cmpchat run` (greedy, no thinking) and then the app in a real terminal (tmux, or a bare
pseudo-terminal whose output is read and dropped where tmux is missing, as on the GPU test machine) with the
same prompt and settings, reading the app's figure from its history database. Rounds alternate so a
busy machine affects both sides alike; the ratio of medians is the result. Not part of the test suite
(it takes minutes); the issue's pass mark is a ratio of at least 0.95. CMPCHAT_SPEED_TERMINAL=pty forces
the pseudo-terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Tell me a story about a GPU"
PROFILE_SECONDS = 3
"""How long `--profile` samples the app from the moment the prompt is sent."""
RUN_SPEED = re.compile(r"reply: (\d+) tokens, ([\d.]+) tok/s")
GC_PROBE = """
import atexit, gc, json, os, runpy, sys, threading, time
_started, _totals, _written = {}, {}, [0.0]
def _write():
    _written[0] = time.perf_counter()
    with open(os.environ["CMPCHAT_GC_PROBE"], "w") as f:
        json.dump(_totals, f)
def _note(phase, info):
    thread = threading.current_thread().name
    if phase == "start":
        _started[thread] = time.perf_counter()
        return
    took = time.perf_counter() - _started.pop(thread, time.perf_counter())
    key = f"{thread} gen{info['generation']}"
    count, total, longest = _totals.get(key, (0, 0.0, 0.0))
    _totals[key] = (count + 1, total + took, max(longest, took))
    if time.perf_counter() - _written[0] > 0.5:
        _write()
gc.callbacks.append(_note)
atexit.register(_write)
sys.argv[0] = "cmpchat"
runpy.run_module("cmpchat", run_name="__main__", alter_sys=True)
"""
"""With --gc, the commands run under this: every garbage collection's duration, summed by thread and
generation, is written to $CMPCHAT_GC_PROBE twice a second and at exit (the app is killed: no exit)."""


def cmpchat_command(gc_probe: Path | None) -> tuple[list[str], dict[str, str]]:
    """How to start cmpchat, and the environment it needs, with or without the GC probe."""
    if gc_probe is None:
        return [sys.executable, "-m", "cmpchat"], {}
    return [sys.executable, "-c", GC_PROBE], {"CMPCHAT_GC_PROBE": str(gc_probe)}


def read_gc(gc_probe: Path | None) -> dict[str, list[float]]:
    if gc_probe is None or not gc_probe.exists():
        return {}
    return json.loads(gc_probe.read_text())


def print_gc(gc_probe: Path | None, who: str, before: dict[str, list[float]] | None = None) -> None:
    """The probe's figures, less those of `before` (the collections while the model loaded)."""
    for key, (count, total, longest) in sorted(read_gc(gc_probe).items()):
        base_count, base_total, _ = (before or {}).get(key, (0, 0.0, 0.0))
        count, total = count - base_count, total - base_total
        if count:
            print(
                f"  {who} GC {key}: {count} collections, {total * 1000:.0f} ms (longest of all {longest * 1000:.1f} ms)"
            )


def run_cli(model: str | None, tokens: int, gc_probe: Path | None) -> float:
    cmpchat, probe_env = cmpchat_command(gc_probe)
    command = [*cmpchat, "run", "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--no-think"]
    if model:
        command += ["-m", model]
    env = {**os.environ, **probe_env}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True, env=env)
    match = RUN_SPEED.search(result.stderr)
    assert match, result.stderr
    print(f"  cmpchat run: {match.group(1)} tokens", flush=True)
    print_gc(gc_probe, "cmpchat run")
    return float(match.group(2))


def run_app(
    model: str | None,
    tokens: int,
    size: tuple[int, int],
    timeout: float,
    profile: Path | None,
    gc_probe: Path | None,
    app_args: list[str],
) -> float:
    home = Path(tempfile.mkdtemp(prefix="cmpchat-speed-"))
    config = home / "config" / "cmpchat" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"max_tokens = {tokens}\nthinking = false\ntemperature = 0\n")
    # The repository first, then whatever the caller put on the path (the GPU machine's carried wheels).
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cmpchat, probe_env = cmpchat_command(gc_probe)
    env = {"XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"), "PYTHONPATH": python_path}
    env.update(probe_env)
    source = ["-m", model] if model else ["--demo"]
    command = [*cmpchat, *source, *app_args]
    use_tmux = shutil.which("tmux") and os.environ.get("CMPCHAT_SPEED_TERMINAL") != "pty"
    terminal = TmuxTerminal(command, env, size) if use_tmux else PtyTerminal(command, env, size)
    started = time.monotonic()
    try:
        _wait(terminal.ready, 300, "showed no loaded model", terminal)
        print(f"  the app loaded the model in {time.monotonic() - started:.0f} s; sending the prompt", flush=True)
        if gc_probe is not None:
            time.sleep(0.6)  # the probe's next write
        loaded_gc = read_gc(gc_probe)
        terminal.type(PROMPT)
        time.sleep(0.3)
        terminal.enter()
        recorder = _record_gil(terminal.pid(), PROFILE_SECONDS, profile) if profile else None
        database = home / "data" / "cmpchat" / "history.sqlite3"
        _wait(lambda: _finished_stats(database) is not None, timeout, "saved no finished reply", terminal)
        stats = _finished_stats(database)
        assert stats is not None
        print(f"  the app: {stats['generated_tokens']} tokens", flush=True)
        if gc_probe is not None:
            time.sleep(0.6)  # the probe's next write
        print_gc(gc_probe, "the app, during the reply:", loaded_gc)
        if recorder is not None:
            recorder.wait(PROFILE_SECONDS + 30)
            print(f"  GIL profile of the app: {profile}", flush=True)
        return stats["decode_tokens_per_second"]
    finally:
        terminal.close()


def _app_ready(screen: str) -> bool:
    """The header shows the backend once the model is loaded."""
    return "· CPU" in screen or " GPU" in (screen.splitlines() or [""])[0]


class TmuxTerminal:
    def __init__(self, command: list[str], env: dict[str, str], size: tuple[int, int]) -> None:
        self.tmux = ["tmux", "-L", f"cmpchat-speed-{os.getpid()}"]
        line = " ".join(shlex.quote(p) for p in ["env", *(f"{k}={v}" for k, v in env.items()), *command])
        # The pane outlives the app, so an app that exits leaves its last screen (a traceback) to read.
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "s", "-x", str(size[0]), "-y", str(size[1]), line,
                        ";", "set-option", "-t", "s", "remain-on-exit", "on"], check=True)  # fmt: skip

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "s"], capture_output=True, text=True).stdout

    def ready(self) -> bool:
        return _app_ready(self.screen())

    def type(self, text: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "s", "-l", text], check=True)

    def enter(self) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "s", "Enter"], check=True)

    def pid(self) -> int | None:
        pid = subprocess.run([*self.tmux, "display-message", "-p", "-t", "s", "#{pane_pid}"], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
        return int(pid) if pid.isdigit() else None

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


class PtyTerminal:
    """The app on a pseudo-terminal of the given size; a thread reads (and drops) everything it draws, as
    a terminal would, keeping only the recent text to see when the app is ready."""

    ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_][0-?]*[ -/]*[@-~]?")

    def __init__(self, command: list[str], env: dict[str, str], size: tuple[int, int]) -> None:
        import fcntl
        import pty
        import struct
        import termios
        import threading

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        self.process = subprocess.Popen(
            command, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, start_new_session=True,
            env={**os.environ, "TERM": "xterm-256color", **env},
        )  # fmt: skip
        os.close(slave)
        self.recent = ""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.recent = (self.recent + self.ESCAPES.sub("", data.decode(errors="replace")))[-20000:]

    def screen(self) -> str:
        return self.recent[-3000:]

    def ready(self) -> bool:
        return "ctx " in self.recent  # the title bar shows the context once the model is loaded

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def enter(self) -> None:
        os.write(self.master, b"\r")

    def pid(self) -> int | None:
        return self.process.pid

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
        os.close(self.master)


def _py_spy() -> str | None:
    # A wheel installed with --target (the GPU machine's carried wheels) puts it in bin/ beside the packages.
    candidates = [shutil.which("py-spy"), *(str(Path(p) / "bin" / "py-spy") for p in sys.path if p)]
    return next((c for c in candidates if c and Path(c).exists()), None)


def _thread_stacks(pid: int | None) -> str:
    """Every thread's Python stack in the app's process (py-spy, where installed): what a stalled app waits on."""
    py_spy = _py_spy()
    if not py_spy or pid is None:
        return "(py-spy is not installed or the app has exited: no thread stacks)"
    dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return f"the app's threads (py-spy dump):\n{dump.stdout}{dump.stderr}"


def _record_gil(pid: int | None, seconds: float, output: Path) -> subprocess.Popen | None:
    """Sample which thread holds the GIL for `seconds` (py-spy record --gil, collapsed stacks), in the
    background: where the app's Python time goes while the engine generates."""
    py_spy = _py_spy()
    if not py_spy or pid is None:
        print("  (py-spy is not installed: no profile)", flush=True)
        return None
    command = [py_spy, "record", "--gil", "--threads", "-r", "250", "-f", "raw", "-d", str(max(1, round(seconds))),
               "-o", str(output), "--pid", str(pid)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _finished_stats(database: Path) -> dict | None:
    """The app's statistics of its finished reply, once it has saved one."""
    if not database.exists():
        return None
    with sqlite3.connect(database) as db:
        row = db.execute("SELECT stats FROM messages WHERE role='assistant' AND status='complete'").fetchone()
    return json.loads(row[0]) if row else None


def _wait(condition, timeout: float, failure: str, terminal) -> None:
    """Until `condition()`; after `timeout` seconds, exit saying `failure`, with the app's screen."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the app {failure} within {timeout:.0f} s; its screen:\n{terminal.screen()}\n{_thread_stacks(terminal.pid())}"
            )
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="GGUF file or a released size such as 0.8B (a benchmark file, built "
                        "once in --folder); default: the demo model")  # fmt: skip
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cmpchat-bench")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="160x48")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the app may take for one reply")
    parser.add_argument("--profile", type=Path, help="folder for a py-spy GIL profile of the app in each round")
    parser.add_argument("--app-args", default="", help="more arguments for the app, e.g. '--simulated-gpus 1'")
    parser.add_argument("--gc", action="store_true", help="time every garbage collection, by thread, on both sides")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    if args.model:
        sys.path.insert(0, str(REPO))
        from cmpchat.bench.model_files import bench_model_path

        args.model = str(bench_model_path(args.model, args.folder))
        print(f"model: {args.model}", flush=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    cli, app = [], []
    for round_ in range(args.rounds):
        probes = Path(tempfile.mkdtemp(prefix="cmpchat-gc-")) if args.gc else None
        cli.append(run_cli(args.model, args.tokens, probes / "run.json" if probes else None))
        print(f"round {round_ + 1}: cmpchat run {cli[-1]:.1f} tok/s; starting the app", flush=True)
        profile = args.profile / f"app-gil-{round_ + 1}.txt" if args.profile else None
        app_probe = probes / "app.json" if probes else None
        app.append(run_app(args.model, args.tokens, size, args.timeout, profile, app_probe, args.app_args.split()))  # type: ignore[arg-type]
        print(f"round {round_ + 1}: cmpchat run {cli[-1]:.1f} tok/s, app {app[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(app) / statistics.median(cli)
    print(
        f"median: cmpchat run {statistics.median(cli):.1f} tok/s, app {statistics.median(app):.1f} tok/s, ratio {ratio:.3f}"
    )
    print(f"best:   cmpchat run {max(cli):.1f} tok/s, app {max(app):.1f} tok/s, ratio {max(app) / max(cli):.3f}")


if __name__ == "__main__":
    main()
