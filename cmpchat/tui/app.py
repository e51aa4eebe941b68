"""`CmpchatApp`: settings, themes and keys, the history store, the model (loaded on a worker thread with
progress), the GPU monitor, and the chat screen that does the rest."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.reactive import var
from textual.screen import Screen

from cmpchat.errors import CmpchatError
from cmpchat.gpu_readings import GpuMonitor, GpuReading, GpuSampler, GpuStage, open_nvml_sampler
from cmpchat.history.images import ImageStore
from cmpchat.history.store import HistoryStore, SearchHit
from cmpchat.long_lived import freeze_loaded, thaw_before_replacing
from cmpchat.model.discovery import FoundModel, default_roots, find_models
from cmpchat.paths import data_dir
from cmpchat.tui.model_request import ChatModel, ModelOpener, ModelRequest, open_requested
from cmpchat.tui.remote_model import RemoteModel
from cmpchat.tui.screens.chat_screen import ChatScreen
from cmpchat.tui.screens.dialog_flows import delete_chat, rename_chat
from cmpchat.tui.screens.help import HelpScreen, binding_rows, pretty_keys
from cmpchat.tui.screens.model_picker import ModelPickerScreen
from cmpchat.tui.server_gpus import ServerGpuPoller, ServerGpuReport
from cmpchat.tui.session import ChatSession
from cmpchat.tui.settings import AppState, Settings, load_state, save_state, settings_path
from cmpchat.tui.themes import DEFAULT_THEME, load_themes
from cmpchat.tui.widgets.chat_list import ChatRows
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from cmpchat.tui.widgets.prompt import PromptArea

__all__ = ["CmpchatApp", "ModelRequest"]

_PROGRESS_INTERVAL = 0.1
"""Seconds between load progress reports sent to the screen (the builder reports far more often)."""
GIL_SWITCH_SECONDS = {"cpu": 0.02, "cuda": 0.0001}
"""How long a thread may keep the GIL while another waits for it (Python's default: 0.005), by backend;
replies are generated on a thread of the app's process. On the CPU that thread computes holding the GIL,
and at the default the UI's timers and frames took it four times as often: at 1,600 tok/s (tiny model)
the app decoded at 0.83-0.90 of `cmpchat run`, at 0.02 s 0.91-1.0. On a GPU it lets the GIL go at each
driver call and while each step runs, and needs it back at once: while the UI draws a frame it waits up to
the whole interval each time. With one step queued ahead of the host (H200, 0.8B shape, 720 tok/s) the
app decoded at 0.957 of `cmpchat run` at 1 ms and 0.998 at 0.1 ms (and at 0.05 ms). A key press waits at
most this."""


class CmpchatApp(App[None]):
    """The `cmpchat` terminal app. Every collaborator can be passed in, so tests run it on fakes."""

    CSS_PATH = "app.tcss"
    TITLE = "cmpchat"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding(
            "ctrl+q",
            "quit",
            "quit",
            id="app.quit",
            priority=True,
            show=False,
            tooltip="Quit (a reply being written is kept)",
        ),
        Binding("f1", "help", "keys", id="app.help", show=False, tooltip="This list of keys"),
    ]

    model: var[ChatModel | None] = var(None)
    gpu_readings: var[tuple[GpuReading, ...]] = var(())
    gpu_problem: var[str | None] = var(None)
    gpu_stages: var[tuple[GpuStage, ...]] = var(())
    """The model's pipeline stages on the GPUs shown, and what the engine does (the GPU panel's stage column)."""

    @dataclass
    class LoadProgressed(Message):
        stage: str
        done: int
        total: int

    @dataclass
    class ModelLoaded(Message):
        request: ModelRequest
        model: ChatModel

    @dataclass
    class GpuReadings(Message):
        readings: tuple[GpuReading, ...]
        problem: str | None
        source: object
        """The monitor or poller that read them: readings from a source no longer shown are dropped."""
        stages: tuple[GpuStage, ...] | None = None
        """A server's stages on its GPUs; None for this machine's, which the model in this process says."""

    @dataclass
    class ModelFailed(Message):
        request: ModelRequest
        error: str

    def __init__(
        self,
        *,
        model_request: ModelRequest | None = None,
        settings: Settings | None = None,
        settings_problems: list[str] | None = None,
        state: AppState | None = None,
        state_file: Path | None = None,
        history: HistoryStore | None = None,
        images: ImageStore | None = None,
        gpu_sampler: GpuSampler | None = None,
        discover: Callable[[], list[FoundModel]] | None = None,
        opener: ModelOpener | None = None,
        load_options: dict[str, Any] | None = None,
        theme_folders: list[Path] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings or Settings()
        self.settings_problems = settings_problems or []
        self.state_file = state_file
        self.app_state = state if state is not None else load_state(state_file)
        self.history = history or HistoryStore(data_dir() / "history.sqlite3")
        self.images = images or ImageStore(data_dir() / "images")
        self.requested_model = model_request
        self.discover = discover or (lambda: find_models(default_roots(self.settings.model_dirs)))
        self.opener = opener
        self.load_options = load_options or {}
        """`open_model`'s layout options from the command line (`--gpus`, `--gpu-mem`, `--ctx`...)."""
        self._gpu_sampler = gpu_sampler
        self._gpu_monitor: GpuMonitor | None = None
        self._server_gpus: ServerGpuPoller | None = None
        """While the model is a server's: what reads the server's GPUs, shown instead of this machine's."""
        self._theme_folders = theme_folders
        self._loaded_request: ModelRequest | None = None
        self.set_keymap(self.settings.keymap)

    # -- start and end --------------------------------------------------------------------------

    def get_default_screen(self) -> ChatScreen:
        session = ChatSession(self.history, self.images, self.settings.chat_options())
        if self.app_state.last_chat is not None:
            session = (
                ChatSession.open(self.history, self.images, self.settings.chat_options(), self.app_state.last_chat)
                or session
            )
        thinking = self.settings.thinking if self.app_state.thinking is None else self.app_state.thinking
        return ChatScreen(session, thinking=thinking, show_chat_list=self.settings.show_chat_list)

    def on_mount(self) -> None:
        self._register_themes()
        for problem in self.settings_problems:
            self.notify(problem, severity="warning", timeout=8)
        interrupted = self.history.recover_interrupted()
        if interrupted:
            self.notify(
                f"{interrupted} repl{'ies were' if interrupted > 1 else 'y was'} cut off when cmpchat last ended; "
                "kept and marked interrupted.",
                timeout=6,
            )
        self._start_gpu_monitor()
        if not self.is_headless:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self._terminate)
            loop.add_signal_handler(signal.SIGHUP, self._terminal_gone)

    def on_ready(self) -> None:
        # After the first screen is composed: loading reports progress into it.
        self._choose_model()

    def _terminate(self) -> None:
        """SIGTERM: leave normally (restoring the terminal), but never hang on the way out."""
        self._save_interrupted()
        self._save_state()
        fallback = threading.Timer(3.0, os._exit, args=(128 + signal.SIGTERM,))
        fallback.daemon = True
        fallback.start()
        self.exit()

    def _terminal_gone(self) -> None:
        """SIGHUP: the SSH session or tmux server went away. There is no terminal left to restore, and
        writing to the dead one can block the normal shutdown, so keep the reply and state and leave."""
        self._save_interrupted()
        self._save_state()
        self.history.close()
        os._exit(128 + signal.SIGHUP)

    def _save_interrupted(self) -> None:
        screen = self.chat_screen
        if screen is not None:
            screen.save_interrupted()

    def on_unmount(self) -> None:
        if self._gpu_monitor is not None:
            self._gpu_monitor.stop()
        if self._server_gpus is not None:
            self._server_gpus.stop()
        self._save_state()
        self.history.close()

    @property
    def chat_screen(self) -> ChatScreen | None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                return screen
        return None

    # -- themes, keys, remembered state ---------------------------------------------------------

    def _register_themes(self) -> None:
        themes, problems = load_themes(self._theme_folders)
        for theme in themes:
            self.register_theme(theme)
        for problem in problems:
            self.notify(problem, severity="warning", timeout=8)
        wanted = self.app_state.theme or self.settings.theme
        if wanted not in self.available_themes:
            if wanted != DEFAULT_THEME:
                self.notify(f"theme '{wanted}' not found; using {DEFAULT_THEME}", severity="warning")
            wanted = DEFAULT_THEME if DEFAULT_THEME in self.available_themes else "textual-dark"
        self.theme = wanted
        self._themes_ready = True

    def watch_theme(self, theme: str) -> None:
        # Changes after start-up are the person's choice (the palette's theme picker): remember them.
        if getattr(self, "_themes_ready", False) and self.app_state.theme != theme:
            self.app_state.theme = theme
            self._save_state()

    def remember_thinking(self, thinking: bool) -> None:
        self.app_state.thinking = thinking
        self._save_state()

    def remember_chat(self, chat_id: int | None) -> None:
        if self.app_state.last_chat != chat_id:
            self.app_state.last_chat = chat_id
            self._save_state()  # now, not at exit: after a crash the chat that was open opens again

    def _save_state(self) -> None:
        try:
            save_state(self.app_state, self.state_file)
        except OSError as err:
            self.log.warning(f"could not save the app state: {err}")

    def action_help(self) -> None:
        prompt_keys = [b for b in PromptArea.BINDINGS if isinstance(b, Binding) and (b.id or "").startswith("prompt.")]
        bindings = [*ChatScreen.BINDINGS, *prompt_keys, *ChatRows.BINDINGS, *self.BINDINGS]
        self.push_screen(HelpScreen(binding_rows(bindings, self.settings.keymap), str(settings_path())))

    # -- the command palette --------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's commands (its screenshot replaced by ours), every chat action the screen allows now,
        renaming and deleting the open chat, and the key list: F1 says the palette holds every action."""
        for command in super().get_system_commands(screen):
            if command.title != "Screenshot":
                yield command
        yield SystemCommand(
            "Screenshot",
            "Save an SVG picture of the screen in the current folder",
            lambda: self.set_timer(0.1, self.action_screenshot),  # once the palette has closed
        )
        if isinstance(screen, ChatScreen):
            for binding in ChatScreen.BINDINGS:
                if isinstance(binding, Binding) and binding.tooltip and screen.check_action(binding.action, ()):
                    keys = pretty_keys(self.settings.keymap.get(binding.id or "", binding.key))
                    yield SystemCommand(binding.tooltip, keys, partial(screen.run_action, binding.action))
            chat = screen.session.chat
            if chat is not None:  # the chat list's own keys, for the open chat
                yield SystemCommand("Rename this chat", "R in the chat list", partial(rename_chat, screen, chat.id))
                yield SystemCommand("Delete this chat", "Del in the chat list", partial(delete_chat, screen, chat.id))
        yield SystemCommand("All keys", "F1: every key, and where to change them", self.action_help)

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """Save an SVG of the screen in `path` (the current folder by default), or say why it could not be.

        Textual's own saves to ~/Downloads, which a server seldom has, and reports a failure without its
        reason."""
        try:
            saved = self.save_screenshot(filename, path or str(Path.cwd()))
        except OSError as err:
            self.notify(f"Could not save it: {err.strerror or err}", title="Screenshot", severity="error")
            return
        self.notify(f"Saved {saved}", title="Screenshot", timeout=4)

    # -- history --------------------------------------------------------------------------------

    def search_chats(self, text: str) -> list[SearchHit]:
        return self.history.search(text)

    # -- the model ------------------------------------------------------------------------------

    @property
    def model_label(self) -> str:
        model = self.model
        if model is None:
            return "no model"
        if isinstance(model, RemoteModel):
            return model.name
        return "demo model" if model.is_demo else model.path.name

    @property
    def device_label(self) -> str:
        model = self.model
        if model is None:
            return ""
        if isinstance(model, RemoteModel):
            return model.server.address
        gpus = len(self.gpu_readings)
        backend = getattr(model.backend, "name", "cpu")
        return f"{gpus} GPU{'s' if gpus != 1 else ''}" if backend not in ("cpu", "reference") and gpus else "CPU"

    def _choose_model(self) -> None:
        if self.requested_model is not None:
            self.load_model(self.requested_model)
            return
        last = self.app_state.last_model
        if last is not None and (last == "" or Path(last).is_file()):
            self.load_model(ModelRequest.from_remembered(last))
            return
        self._discover_first_model()

    @work(thread=True, exclusive=True, group="discover", exit_on_error=False)
    def _discover_first_model(self) -> None:
        found = self.discover()
        if any(model.supported for model in found):
            self.call_from_thread(self.open_model_picker, found, False)
        else:
            self.call_from_thread(self.load_model, ModelRequest(None))

    def open_model_picker(self, found: list[FoundModel] | None = None, can_cancel: bool = True) -> None:
        def chosen(request: ModelRequest | None) -> None:
            if request is not None:
                self.load_model(request)

        discover = (lambda: found) if found is not None else self.discover
        self.push_screen(ModelPickerScreen(discover, can_cancel=can_cancel), chosen)

    def load_model(self, request: ModelRequest) -> None:
        screen = self.chat_screen
        if screen is not None:
            if screen.generating:
                self.notify("Stop the reply first (Esc), then change the model.", severity="warning")
                return
            screen.show_loading(request.label)
        self.model = None
        self._load(request)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, request: ModelRequest) -> None:
        last_report = 0.0

        def progress(stage: str, done: int, total: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            if now - last_report >= _PROGRESS_INTERVAL or (total and done >= total):
                last_report = now
                self.post_message(self.LoadProgressed(stage, done, total))

        thaw_before_replacing()
        try:
            model = open_requested(request, self.settings.backend, progress, self.opener, self.load_options)
        except CmpchatError as err:
            self.post_message(self.ModelFailed(request, str(err)))
            return
        except Exception as err:  # a driver or file problem: say so and let the person pick again
            self.post_message(self.ModelFailed(request, f"{type(err).__name__}: {err}"))
            return
        freeze_loaded()
        self.post_message(self.ModelLoaded(request, model))

    def on_cmpchat_app_load_progressed(self, message: LoadProgressed) -> None:
        screen = self.chat_screen
        if screen is not None:
            screen.loading_progress(message.stage, message.done, message.total)

    def on_cmpchat_app_model_loaded(self, message: ModelLoaded) -> None:
        self._loaded_request = message.request
        self.model = message.model
        self._show_gpus_of(message.model)
        if isinstance(message.model, RemoteModel):
            return  # nothing generates in this process, and a server is not the model to open next time
        sys.setswitchinterval(GIL_SWITCH_SECONDS.get(message.model.backend.name, 0.005))
        self.app_state.last_model = message.request.remembered
        self._save_state()  # the demo model says what it is in the banner over the chat, not in a notice

    def on_cmpchat_app_model_failed(self, message: ModelFailed) -> None:
        screen = self.chat_screen
        if screen is not None:
            screen.loading_failed()
        self.notify(message.error, title=f"Could not open {message.request.label}", severity="error", timeout=10)
        if message.request.server is None:  # a server that cannot be reached is not helped by a file picker
            self.open_model_picker()

    # -- GPUs -----------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="gpu-start", exit_on_error=False)
    def _start_gpu_monitor(self) -> None:
        # Opening NVML can take a while on a busy box: done here, never on the UI thread.
        sampler = self._gpu_sampler or open_nvml_sampler()
        self.call_from_thread(self._gpu_sampler_ready, sampler)

    def _gpu_sampler_ready(self, sampler: GpuSampler) -> None:
        self._gpu_sampler = sampler
        if self._server_gpus is None:
            self.gpu_problem = sampler.problem

        # post_message never blocks, so stopping the monitor cannot wait on a UI that is shutting down.
        def post(readings: list[GpuReading]) -> None:
            self.post_message(self.GpuReadings(tuple(readings), sampler.problem, monitor))

        monitor = GpuMonitor(sampler, post, self.settings.gpu_sample_seconds)
        self._gpu_monitor = monitor
        monitor.start()

    def _show_gpus_of(self, model: ChatModel) -> None:
        """A server's model shows the server's GPUs (read from its endpoint), a local one this machine's."""
        was_remote = self._server_gpus is not None
        if self._server_gpus is not None:
            self._server_gpus.stop()
            self._server_gpus = None
        if isinstance(model, RemoteModel):

            def post(report: ServerGpuReport) -> None:
                self.post_message(self.GpuReadings(report.readings, report.problem, poller, report.stages))

            poller = ServerGpuPoller(model.server, post, self.settings.gpu_sample_seconds)
            self._server_gpus = poller
            self.gpu_readings, self.gpu_problem = (), None  # "reading GPUs…" until the server answers
            self.gpu_stages = ()
            poller.start()
        elif was_remote and self._gpu_sampler is not None:
            self.gpu_readings, self.gpu_problem = (), self._gpu_sampler.problem
            self.gpu_stages = ()

    def on_cmpchat_app_gpu_readings(self, message: GpuReadings) -> None:
        if message.source is not (self._server_gpus or self._gpu_monitor):
            return
        self.gpu_stages = message.stages if message.stages is not None else self._local_stages()
        self.gpu_readings = message.readings
        self.gpu_problem = message.problem

    def _local_stages(self) -> tuple[GpuStage, ...]:
        """The stages of the model this process runs, read at each GPU reading (cheap: no driver call)."""
        model = self.model
        if model is None or isinstance(model, RemoteModel):
            return ()
        return tuple(model.gpu_stages() or ())

    def watch_gpu_stages(self, stages: tuple[GpuStage, ...]) -> None:
        # The chat screen's side panel; the full-screen list watches this itself.
        screen = self.chat_screen
        if screen is not None:
            for panel in screen.query(GpuPanel):
                panel.stages = stages
