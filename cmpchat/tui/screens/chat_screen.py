"""The main screen: chat list, conversation and prompt, speed and GPU panels, and every chat action.

Generation runs on a thread worker that only fills a `ReplyBuffer`; a timer drains it at
`Settings.refresh_hz` and updates the reply, the panels and the stored message in one go.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer

from cmpchat.chat.messages import Message
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.tui.model_request import ChatModel, context_limit, model_sees_images, why_no_images
from cmpchat.tui.reply_run import ReplyRun, UpdatePacer
from cmpchat.tui.reply_stream import ReplyUpdate, run_generation
from cmpchat.tui.screens import copy_flows, dialog_flows, slash_flows
from cmpchat.tui.screens.dialogs import ConfirmDialog
from cmpchat.tui.screens.overlays import ChatListScreen, GpuScreen
from cmpchat.tui.session import ChatSession, ReplyStats
from cmpchat.tui.slash_commands import CommandCall
from cmpchat.tui.slash_commands import parse as parse_slash
from cmpchat.tui.widgets.chat_list import ChatList
from cmpchat.tui.widgets.conversation import Conversation
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from cmpchat.tui.widgets.load_progress import LoadProgress
from cmpchat.tui.widgets.prompt import Attachment, AttachmentBar, PromptArea
from cmpchat.tui.widgets.speed_panel import SpeedPanel, SpeedStats
from cmpchat.tui.widgets.status_bar import StatusBar
from cmpchat.tui.widgets.title_bar import DemoBanner, TitleBar

if TYPE_CHECKING:
    from cmpchat.tui.app import CmpchatApp

WIDE = 120
"""Columns from which the chat list and the right panel are shown beside the conversation."""
SAVE_SECONDS = 0.5
"""Most seconds of a streaming reply that a killed process can lose: it is written to history this often."""
_WAITING_FOR_MODEL = "waiting for the model to load: the reply starts as soon as it is ready"
_MODEL_FAILED = "the model did not load: choose one (F4) and the reply starts once it has loaded"


class ChatScreen(Screen[None]):
    """Everything the person works with; dialogs and overlays are pushed above it."""

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]

    BINDINGS = [
        Binding(
            "escape", "stop", "stop", id="chat.stop", priority=True, tooltip="Stop the reply; keep what was written"
        ),
        Binding("ctrl+n", "new_chat", "new", id="chat.new", tooltip="Start a new chat"),
        Binding("ctrl+r", "regenerate", "regen", id="chat.regenerate", tooltip="Write the last reply again"),
        Binding("ctrl+e", "edit_last", "edit", id="chat.edit_last", tooltip="Edit the last message and send it again"),
        Binding(
            "ctrl+t",
            "toggle_thinking",
            "thinking",
            id="chat.thinking",
            show=False,
            priority=True,
            tooltip="Thinking on/off for the next replies",
        ),
        # Ctrl+I arrives as Tab unless the terminal speaks the kitty keyboard protocol: Ctrl+O always works.
        Binding(
            "ctrl+i,ctrl+o",
            "attach_image",
            "image",
            id="chat.attach_image",
            show=False,
            priority=True,
            tooltip="Attach an image to the next message",
        ),
        Binding("ctrl+s", "chat_settings", "system", id="chat.settings", tooltip="System prompt and sampling"),
        Binding("ctrl+x", "export", "export", id="chat.export", tooltip="Export this chat to Markdown"),
        Binding("f2", "chats", "chats", id="chat.chats", tooltip="Show or hide the chat list"),
        Binding(
            "ctrl+f", "search_chats", "search", id="chat.search", show=False, priority=True, tooltip="Search all chats"
        ),
        Binding("alt+up", "pick_turn(-1)", "pick", id="chat.pick_above", show=False, tooltip="Pick the message above"),
        Binding("alt+down", "pick_turn(1)", "pick", id="chat.pick_below", show=False, tooltip="Pick the message below"),
        # F5 to F7 select text in the prompt (TextArea's keys), which has the focus most of the time.
        Binding(
            "f8",
            "copy_message",
            "copy",
            id="chat.copy",
            show=False,
            tooltip="Copy the picked message (the last unless Alt+Up picked another)",
        ),
        Binding(
            "f9",
            "copy_code",
            "copy code",
            id="chat.copy_code",
            show=False,
            tooltip="Copy a code block of the picked message (again: the one before)",
        ),
        Binding("f3", "gpus", "GPUs", id="chat.gpus", tooltip="Every GPU, full width"),
        Binding("f4", "pick_model", "model", id="chat.model", tooltip="Choose another model"),
    ]

    speed: reactive[SpeedStats] = reactive(SpeedStats)
    thinking: reactive[bool] = reactive(True)
    generating: reactive[bool] = reactive(False, bindings=True)

    def __init__(self, session: ChatSession, *, thinking: bool, show_chat_list: bool) -> None:
        super().__init__()
        self.session = session
        self.set_reactive(ChatScreen.thinking, thinking)
        self.show_chat_list = show_chat_list
        self.active_reply: ReplyRun | None = None
        self.attachments: list[Attachment] = []
        self._tick_timer: Timer | None = None
        self.copied_code: tuple[Widget, int] | None = None
        """The turn and index of the code block F9 copied last, so that F9 again copies the one before."""

    @property
    def cmp(self) -> CmpchatApp:
        return cast("CmpchatApp", self.app)

    # -- layout -----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield TitleBar(id="title-bar").data_bind(thinking=ChatScreen.thinking)
        yield DemoBanner()
        with Horizontal(id="main"):
            yield ChatList(self.cmp.search_chats, id="sidebar")
            with Vertical(id="centre"):
                yield LoadProgress(id="load-progress")
                yield Conversation(id="conversation")
                yield AttachmentBar(id="attachments")
                yield PromptArea(sent=self._sent_texts, id="prompt")
            with Vertical(id="side-panel"):
                yield SpeedPanel(id="speed").data_bind(stats=ChatScreen.speed)
                yield GpuPanel(id="gpus")
        yield StatusBar(id="status-bar").data_bind(stats=ChatScreen.speed)
        yield Footer(id="footer", compact=True, show_command_palette=False)

    async def on_mount(self) -> None:
        self.set_class(not self.show_chat_list, "-hide-chats")
        self.query_one("#load-progress").display = False
        self.query_one(DemoBanner).display = False
        self.watch(self.app, "model", self._model_changed)
        self.watch(self.app, "gpu_readings", self._gpu_readings_changed)
        self.watch(self.app, "gpu_problem", self._gpu_problem_changed)
        await self._show_session()
        prompt = self.query_one(PromptArea)
        prompt.border_title = "message"
        prompt.border_subtitle = self._prompt_subtitle()
        prompt.focus()

    def _sent_texts(self) -> list[str]:
        return [m.content for m in self.session.messages if m.role == "user" and m.content]

    def _prompt_subtitle(self) -> str:
        return f"thinking {'on' if self.thinking else 'off'} · ^P commands · F1 keys"

    def watch_speed(self, speed: SpeedStats) -> None:
        if self.is_mounted:
            self.query_one(TitleBar).context_used = speed.context_used

    def watch_thinking(self) -> None:
        if self.is_mounted:
            self.query_one(PromptArea).border_subtitle = self._prompt_subtitle()

    # -- model and GPUs (attributes down from the app) -------------------------------------------

    def show_loading(self, what: str) -> None:
        self.query_one(LoadProgress).start(what)
        self.speed = replace(self.speed, phase="loading", load_stage="opening", load_fraction=None)

    def loading_progress(self, stage: str, done: int, total: int) -> None:
        self.query_one(LoadProgress).update_progress(stage, done, total)
        fraction = done / total if total > 1 else None
        self.speed = replace(self.speed, phase="loading", load_stage=stage, load_fraction=fraction)

    def loading_failed(self) -> None:
        self.query_one(LoadProgress).stop()
        self.speed = replace(self.speed, phase="error", load_stage="")
        conversation = self.query_one(Conversation)
        if conversation.waiting_for_model:
            conversation.update_waiting(_MODEL_FAILED)

    def _model_changed(self, model: ChatModel | None) -> None:
        title = self.query_one(TitleBar)
        if model is not None:
            self.query_one(LoadProgress).stop()
        self.query_one(DemoBanner).display = bool(model is not None and model.is_demo)
        if model is None:
            title.model_name = "no model"
            return
        title.model_name = self.cmp.model_label
        title.device = self.cmp.device_label
        title.context_max = context_limit(model)
        self.query_one(AttachmentBar).no_images_reason = why_no_images(model)
        self.speed = replace(self.speed, phase="idle", context_max=context_limit(model), load_stage="")
        self._count_context()
        self.call_later(self._reply_to_waiting_message)

    def _gpu_readings_changed(self, readings: tuple) -> None:
        self.query_one(GpuPanel).readings = readings
        self.query_one(StatusBar).readings = readings

    def _gpu_problem_changed(self, problem: str | None) -> None:
        self.query_one(GpuPanel).problem = problem

    # -- sending and streaming ------------------------------------------------------------------

    @on(PromptArea.Submitted)
    async def _submitted(self, event: PromptArea.Submitted) -> None:
        """The prompt has handed over its text (and emptied itself); send it, or give it back."""
        text = event.text.strip()
        prompt = event.prompt_area
        if not text and not self.attachments:
            prompt.restore(event.text)
            return
        parsed = parse_slash(text)
        if isinstance(parsed, CommandCall):
            if not await slash_flows.run_command(self, parsed):
                prompt.restore(event.text)
            return
        text = parsed
        if self.generating:
            self.notify("A reply is being written: Esc stops it.", severity="warning")
            prompt.restore(event.text)
            return
        if self.query_one(Conversation).waiting_for_model:
            self.notify("A message is already waiting for the model to load.", severity="warning")
            prompt.restore(event.text)
            return
        model = self.app_model()
        if model is None and self.attachments:
            # Whether the images can be sent depends on the model: ask once it is there.
            self.notify("The model is still loading: send images once it is ready.", severity="warning")
            prompt.restore(event.text)
            return
        refusal = why_no_images(model) if self.attachments else None
        if refusal is not None:
            # Said before anything is sent; the text and the images stay (here, or stored with the message).
            if not text:
                self.notify(f"This model cannot see images: {refusal}. Add some text to send.", severity="warning")
                prompt.restore(event.text)
                return
            message = (
                f"This model cannot see the attached image{'s' if len(self.attachments) > 1 else ''}: "
                f"{refusal}. Send only your text? The images stay with the message in the chat history."
            )

            async def confirmed(send: bool | None) -> None:
                if send:
                    await self._send(text)
                else:
                    prompt.restore(event.text)

            self.app.push_screen(ConfirmDialog("Images will not be sent", message, yes="Send text only"), confirmed)
            return
        await self._send(text)

    async def _send(self, text: str) -> None:
        """Store and show the message, then reply to it, or, while the model loads, once it has loaded."""
        attachments, self.attachments = self.attachments, []
        self.query_one(AttachmentBar).attachments = ()
        self.session.add_user_message(text, [a.image.id for a in attachments])
        self.cmp.remember_chat(self.session.chat.id if self.session.chat else None)
        conversation = self.query_one(Conversation)
        await conversation.add_user(text, [a.image.path for a in attachments])
        self.refresh_chat_lists()
        if self.app_model() is None:
            await conversation.wait_for_model(_WAITING_FOR_MODEL)
            return
        await self._start_reply()

    async def _reply_to_waiting_message(self) -> None:
        conversation = self.query_one(Conversation)
        if not conversation.waiting_for_model or self.app_model() is None or self.generating:
            return
        await conversation.stop_waiting()
        if self.session.messages and self.session.messages[-1].role == "user":
            await self._start_reply()

    async def _start_reply(self) -> None:
        model = self.app_model()
        assert model is not None
        sees_images = model_sees_images(model)
        leave_out: set[str] = set()
        if sees_images:
            problems = self.session.image_problems()
            current = [problem for problem in problems if problem.current]
            if current:
                # Before the reply starts, not as a failed reply: the message and its images are kept.
                self.notify(
                    f"{current[0].line()} Nothing was sent; the message is kept (Ctrl+E edits it, Ctrl+R sends "
                    "it again).",
                    severity="error",
                    timeout=10,
                )
                return
            if problems:
                leave_out = {problem.image_id for problem in problems}
                self.notify(f"{problems[0].line()} The reply is written without it.", severity="warning", timeout=8)
        messages = self.session.conversation(with_images=sees_images, leave_out=leave_out)
        options = self.session.options.generation_options()
        record = self.session.start_reply(self.cmp.model_label)
        view = await self.query_one(Conversation).add_reply(record.model)
        self.active_reply = ReplyRun(record, view, limit=options.max_tokens or 0)
        self.active_reply.pacer = UpdatePacer(1 / self.cmp.settings.refresh_hz)
        self.generating = True
        self.speed = replace(
            SpeedStats(),
            phase="prompt",
            limit=self.active_reply.limit,
            context_max=self.speed.context_max,
            context_used=self.speed.context_used,
            decode_history=self.speed.decode_history,
        )
        # A blinking cursor repaints the prompt twice a second; while a reply streams that is GIL time
        # taken from the engine for nothing.
        self.query_one(PromptArea).cursor_blink = False
        self._generate(model, messages, options, self.thinking, self.active_reply)
        self._tick_timer = self.set_timer(self.active_reply.pacer.fastest, self._tick)

    @work(thread=True, exclusive=True, group="reply", exit_on_error=False)
    def _generate(
        self, model: ChatModel, messages: list[Message], options: GenerationOptions, thinking: bool, run: ReplyRun
    ) -> None:
        run_generation(
            lambda: model.chat(messages, options, enable_thinking=thinking, cancel=run.cancel),
            run.buffer,
            _describe_error,
        )

    async def _tick(self) -> None:
        """One screen update of the streaming reply; schedules the next one (see `UpdatePacer`)."""
        run = self.active_reply
        if run is None:
            return
        update = run.buffer.drain()
        if update is not None:
            # One frame per update: everything below is drawn together when the batch ends.
            with self.app.batch_update():
                answer_started = run.note_text(update)
                await run.view.append(update.reasoning, update.content, update.tool_calls)
                if answer_started:
                    run.view.fold_reasoning(run.reasoning_seconds)
                self.speed = run.speed(update, self.speed)
                if update.done:
                    await self._finish(run, update)
                    return
            now = time.monotonic()
            if now - run.saved_at >= SAVE_SECONDS:
                run.saved_at = now
                self.session.save_partial(run.record, run.view.content, run.view.reasoning)
        if self.active_reply is run:
            self._tick_timer = self.set_timer(run.pacer.next_interval(), self._tick)

    async def _finish(self, run: ReplyRun, update: ReplyUpdate) -> None:
        self.active_reply = None
        if self._tick_timer is not None:
            self._tick_timer.stop()
        finished = update.finished
        status = run.final_status(update)
        stats = ReplyStats.from_finished(finished, run.reasoning_seconds) if finished else None
        content = finished.content if finished else run.view.content
        reasoning = finished.reasoning if finished else run.view.reasoning
        calls = [event.call for event in finished.tool_calls] if finished else []
        self.session.finish_reply(
            run.record, status, content=content, reasoning=reasoning, tool_calls=calls, stats=stats
        )
        await run.view.finish(content, status, stats)
        if update.error is not None:
            run.view.show_error(update.error)
            self.notify(update.error, severity="error", title="Generation failed")
        self.generating = False
        self.query_one(PromptArea).cursor_blink = True
        if finished is not None:
            t = finished.timings
            self.speed = replace(
                self.speed,
                phase="stopped" if status == "stopped" else "idle",
                decode_rate=t.decode_tokens_per_second or self.speed.decode_rate,
                prompt_rate=t.prompt_tokens_per_second,
                first_token_seconds=t.time_to_first_token,
                generated=t.generated_tokens,
                context_used=t.prompt_tokens + t.generated_tokens,
            )
        else:
            self.speed = replace(self.speed, phase="error")
        self.refresh_chat_lists()

    def on_unmount(self) -> None:
        # Every way the app ends closes this screen, a crash included (Textual then never calls `exit`):
        # the reply's thread must be told to stop here, or the process cannot end while it generates.
        self.save_interrupted()

    def save_interrupted(self) -> None:
        """The app is ending mid-reply: stop the reply, keep what was written, marked interrupted."""
        run, self.active_reply = self.active_reply, None
        if run is None:
            return
        run.cancel.set()
        update = run.buffer.drain() or ReplyUpdate()
        content = run.view.content + update.content
        reasoning = run.view.reasoning + update.reasoning
        self.session.finish_reply(
            run.record, "interrupted", content=content, reasoning=reasoning, tool_calls=[], stats=None
        )

    # -- actions --------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating
        if action in ("regenerate", "edit_last", "new_chat", "pick_model") and self.generating:
            return False
        if action in ("regenerate", "edit_last") and not self.session.messages:
            return None
        return True

    def action_stop(self) -> None:
        if self.active_reply is not None:
            self.active_reply.stop()
            self.speed = replace(self.speed, phase="stopped")

    async def action_regenerate(self) -> None:
        if self.generating or self.app_model() is None:
            return
        if self.session.remove_last_reply() is not None:
            await self.query_one(Conversation).remove_last(1)
        if self.session.messages and self.session.messages[-1].role == "user":
            refusal = why_no_images(self.app_model()) if self.session.messages[-1].images else None
            if refusal is not None:
                self.notify(f"The message's images are not sent: {refusal}.", severity="warning", timeout=6)
            await self._start_reply()

    async def action_edit_last(self) -> None:
        if self.generating:
            return
        removed = self.session.take_last_user_message()
        if not removed:
            self.notify("There is no message to edit yet.")
            return
        conversation = self.query_one(Conversation)
        await conversation.stop_waiting()  # a message waiting for the model is taken back with it
        await conversation.remove_last(len(removed))
        user = removed[0]
        prompt = self.query_one(PromptArea)
        prompt.text = user.content
        prompt.move_cursor(prompt.document.end)
        self.attachments = [
            Attachment(image, "attached image") for i in user.images if (image := self.session.images.get(i))
        ]
        self.query_one(AttachmentBar).attachments = tuple(self.attachments)
        prompt.focus()
        self.refresh_chat_lists()

    def action_toggle_thinking(self) -> None:
        self.thinking = not self.thinking
        self.cmp.remember_thinking(self.thinking)
        self.notify(f"Thinking {'on' if self.thinking else 'off'} from the next reply.", timeout=2)

    def action_attach_image(self) -> None:
        dialog_flows.attach_image(self)

    def action_chat_settings(self) -> None:
        dialog_flows.edit_chat_settings(self)

    def action_export(self) -> None:
        dialog_flows.export_chat(self)

    async def action_new_chat(self) -> None:
        if self.generating:
            return
        self.session = ChatSession(self.session.store, self.session.images, self.cmp.settings.chat_options())
        self.cmp.remember_chat(None)
        await self._show_session()
        self.query_one(PromptArea).focus()

    def action_chats(self) -> None:
        if self.size.width >= WIDE:
            self.toggle_class("-hide-chats")
            return
        self._open_chat_overlay(focus_search=False)

    def action_search_chats(self) -> None:
        if self.size.width >= WIDE:
            self.remove_class("-hide-chats")
            self.query_one(ChatList).focus_search()
            return
        self._open_chat_overlay(focus_search=True)

    def action_pick_turn(self, step: int) -> None:
        self.query_one(Conversation).select(step)

    def action_copy_message(self) -> None:
        copy_flows.copy_message(self)

    def action_copy_code(self) -> None:
        copy_flows.copy_code_block(self)

    def action_gpus(self) -> None:
        self.app.push_screen(GpuScreen(self.cmp.gpu_readings, self.cmp.gpu_problem))

    def action_pick_model(self) -> None:
        self.cmp.open_model_picker()

    # -- chats ----------------------------------------------------------------------------------

    def _open_chat_overlay(self, *, focus_search: bool) -> None:
        async def chosen(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)

        current = self.session.chat.id if self.session.chat else None
        self.app.push_screen(ChatListScreen(self.cmp.search_chats, current, focus_search=focus_search), chosen)

    @on(ChatList.Selected)
    async def _chat_selected(self, event: ChatList.Selected) -> None:
        await self.open_chat(event.chat_id)

    async def open_chat(self, chat_id: int) -> None:
        if self.generating:
            self.notify("Stop the reply first (Esc).", severity="warning")
            return
        session = ChatSession.open(self.session.store, self.session.images, self.cmp.settings.chat_options(), chat_id)
        if session is None:
            self.notify("That chat is gone.", severity="warning")
            return
        self.session = session
        self.cmp.remember_chat(chat_id)
        await self._show_session()

    @on(ChatList.RenameRequested)
    def _rename(self, event: ChatList.RenameRequested) -> None:
        dialog_flows.rename_chat(self, event.chat_id)

    @on(ChatList.DeleteRequested)
    def _delete(self, event: ChatList.DeleteRequested) -> None:
        dialog_flows.delete_chat(self, event.chat_id)

    async def _show_session(self) -> None:
        session = self.session
        self.query_one(TitleBar).chat_title = session.chat.title if session.chat else ""
        await self.query_one(Conversation).show(session.messages, session.images.path)
        self.query_one(PromptArea).sent_history.reset()  # Up now goes through this chat's messages
        self.speed = replace(self.speed, context_used=0, generated=0, first_token_seconds=None)
        self.refresh_chat_lists()
        self._count_context()

    def refresh_chat_lists(self) -> None:
        current = self.session.chat.id if self.session.chat else None
        for screen in (self, self.app.screen):
            for chat_list in screen.query(ChatList):
                chat_list.current_chat = current
                chat_list.refresh_chats()
        self.refresh_bindings()

    def _count_context(self) -> None:
        model = self.app_model()
        if model is not None and self.session.messages:
            self._count_tokens(model, self.session.conversation(with_images=model_sees_images(model)))

    @work(thread=True, exclusive=True, group="context", exit_on_error=False)
    def _count_tokens(self, model: ChatModel, messages: list[Message]) -> None:
        rendered = model.render(messages, enable_thinking=self.thinking)
        used = len(model.tokenize(rendered.text, parse_special=True))
        self.app.call_from_thread(self._context_counted, used)

    def _context_counted(self, used: int) -> None:
        if not self.generating:
            self.speed = replace(self.speed, context_used=used)

    def app_model(self) -> ChatModel | None:
        return self.cmp.model


def _describe_error(err: Exception) -> str:
    if isinstance(err, CmpchatError):
        return str(err)
    return f"{type(err).__name__}: {err}"
