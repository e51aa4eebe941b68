"""The chat screen's actions that go through a dialog: attach an image, chat settings, export, rename,
delete. Each opens its dialog and applies the answer to the screen it was called from."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cmpchat.errors import CmpchatError
from cmpchat.history.export import chat_to_markdown
from cmpchat.tui.model_request import why_no_images
from cmpchat.tui.screens.chat_settings import ChatSettingsScreen
from cmpchat.tui.screens.dialogs import ConfirmDialog, TextInputDialog
from cmpchat.tui.screens.image_picker import ImagePickerScreen
from cmpchat.tui.settings import ChatOptions
from cmpchat.tui.widgets.prompt import Attachment, AttachmentBar
from cmpchat.tui.widgets.title_bar import TitleBar

if TYPE_CHECKING:
    from cmpchat.tui.screens.chat_screen import ChatScreen


def attach_image(screen: ChatScreen) -> None:
    async def chosen(path: Path | None) -> None:
        if path is None:
            return
        try:
            image = screen.session.images.add(path)
        except CmpchatError as err:
            screen.notify(str(err), severity="error")
            return
        screen.attachments.append(Attachment(image, path.name))
        screen.query_one(AttachmentBar).attachments = tuple(screen.attachments)
        reason = why_no_images(screen.app_model())
        if reason is not None:
            screen.notify(
                f"The model cannot see images: {reason}. The image is kept with your message in history but not "
                "sent to the model.",
                severity="warning",
                timeout=6,
            )

    screen.app.push_screen(ImagePickerScreen(Path.cwd()), chosen)


def edit_chat_settings(screen: ChatScreen) -> None:
    def saved(options: ChatOptions | None) -> None:
        if options is not None:
            screen.session.set_options(options)
            screen.notify("Chat settings saved; they apply from the next reply.", timeout=2)

    screen.app.push_screen(ChatSettingsScreen(screen.session.options, screen.session.title), saved)


def export_chat(screen: ChatScreen) -> None:
    session = screen.session
    chat = session.chat
    if chat is None or not session.messages:
        screen.notify("Nothing to export yet.")
        return
    default = Path.cwd() / f"{slug(chat.title)}.md"

    def write(target: str | None) -> None:
        if not target:
            return
        path = Path(target).expanduser()
        text = chat_to_markdown(chat, session.messages, session.images.path)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as err:
            screen.notify(f"Could not write {path}: {err.strerror or err}", severity="error")
            return
        screen.notify(f"Exported to {path}", timeout=4)

    screen.app.push_screen(TextInputDialog("Export this chat to Markdown", str(default), ok="Export"), write)


def rename_chat(screen: ChatScreen, chat_id: int) -> None:
    chat = screen.session.store.chat(chat_id)
    if chat is None:
        return

    def renamed(title: str | None) -> None:
        if not title:
            return
        screen.session.store.rename_chat(chat.id, title)
        if screen.session.chat and screen.session.chat.id == chat.id:
            screen.session.chat.title = title
            screen.query_one(TitleBar).chat_title = title
        screen.refresh_chat_lists()

    screen.app.push_screen(TextInputDialog("Rename chat", chat.title, ok="Rename"), renamed)


def delete_chat(screen: ChatScreen, chat_id: int) -> None:
    chat = screen.session.store.chat(chat_id)
    if chat is None:
        return
    is_open = screen.session.chat is not None and screen.session.chat.id == chat.id

    async def confirmed(delete: bool | None) -> None:
        if not delete:
            return
        if is_open and screen.generating:
            screen.notify("Stop the reply first (Esc).", severity="warning")
            return
        focused = screen.focused  # the chat list, where the person goes on after a delete
        screen.session.store.delete_chat(chat.id)
        if is_open:
            await screen.action_new_chat()
            if focused is not None:
                focused.focus()
        screen.refresh_chat_lists()

    message = f"Delete “{chat.title}” and all its messages?"
    screen.app.push_screen(ConfirmDialog("Delete chat", message, yes="Delete"), confirmed)


def slug(title: str) -> str:
    """A file name from a chat title: "Explain the delta rule!" -> "explain-the-delta-rule"."""
    keep = "".join(c if c.isalnum() else "-" for c in title.lower())
    return "-".join(part for part in keep.split("-") if part)[:48] or "chat"
