"""The open chat: its stored record and messages, and the conversation the model is given.

No Textual here: the chat screen drives it, and tests can too. Every change is written to the
history store at once, so what is on screen is what a restart shows.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from cmpchat.chat.messages import ImagePart, Message, TextPart, ToolCall
from cmpchat.engine.events import Finished
from cmpchat.history.images import ImageStore
from cmpchat.history.store import ChatRecord, HistoryStore, MessageRecord, MessageStatus
from cmpchat.tui.settings import ChatOptions

_TITLE_LENGTH = 48


@dataclass(slots=True)
class ReplyStats:
    """The figures shown under a finished reply and kept with it."""

    generated_tokens: int = 0
    decode_tokens_per_second: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_per_second: float = 0.0
    time_to_first_token: float = 0.0
    reasoning_seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> ReplyStats:
        """From `to_dict`'s form; counts come back as ints (older rows stored every figure as a float)."""
        stats = cls()
        for name in cls.__slots__:  # type: ignore[attr-defined]
            if name in data:
                setattr(stats, name, type(getattr(stats, name))(data[name]))
        return stats

    @classmethod
    def from_finished(cls, finished: Finished, reasoning_seconds: float) -> ReplyStats:
        t = finished.timings
        return cls(
            generated_tokens=t.generated_tokens,
            decode_tokens_per_second=t.decode_tokens_per_second,
            prompt_tokens=t.prompt_tokens,
            prompt_tokens_per_second=t.prompt_tokens_per_second,
            time_to_first_token=t.time_to_first_token,
            reasoning_seconds=reasoning_seconds,
        )


@dataclass(frozen=True, slots=True)
class ImageProblem:
    """An image of the chat that cannot be sent: the `number`th (from 1) of its message's images; `current`
    when that message is the last one the person sent (the one being answered)."""

    image_id: str
    number: int
    current: bool
    reason: str

    def line(self) -> str:
        """One line for the person: which image, and what is wrong with it."""
        where = "your message" if self.current else "an earlier message"
        return f"Image {self.number} of {where} cannot be sent: {self.reason}."


class ChatSession:
    """One chat being shown and continued. `chat` is None until the first message creates the record."""

    def __init__(self, store: HistoryStore, images: ImageStore, defaults: ChatOptions) -> None:
        self.store = store
        self.images = images
        self.defaults = defaults
        self.chat: ChatRecord | None = None
        self.messages: list[MessageRecord] = []
        self.options = ChatOptions.from_dict(defaults.to_dict())

    @classmethod
    def open(cls, store: HistoryStore, images: ImageStore, defaults: ChatOptions, chat_id: int) -> ChatSession | None:
        chat = store.chat(chat_id)
        if chat is None:
            return None
        session = cls(store, images, defaults)
        session.chat = chat
        session.messages = store.messages(chat_id)
        session.options = ChatOptions.from_dict(chat.settings, defaults)
        return session

    @property
    def title(self) -> str:
        return self.chat.title if self.chat else "new chat"

    def set_options(self, options: ChatOptions) -> None:
        self.options = options
        if self.chat is not None:
            self.store.update_chat(self.chat.id, settings=options.to_dict())

    def add_user_message(self, text: str, images: list[str]) -> MessageRecord:
        if self.chat is None:
            self.chat = self.store.create_chat(make_title(text), settings=self.options.to_dict())
        record = self.store.add_message(self.chat.id, "user", text, images=images)
        self.messages.append(record)
        return record

    def start_reply(self, model_name: str) -> MessageRecord:
        """An empty assistant message by `model_name`, stored as "streaming" until `finish_reply`; the chat
        records the model it last used."""
        assert self.chat is not None, "a reply needs a user message first"
        if self.chat.model != model_name:
            self.store.update_chat(self.chat.id, model=model_name)
            self.chat.model = model_name
        record = self.store.add_message(self.chat.id, "assistant", status="streaming", model=model_name)
        self.messages.append(record)
        return record

    def save_partial(self, record: MessageRecord, content: str, reasoning: str) -> None:
        record.content, record.reasoning = content, reasoning
        self.store.update_message(record.id, content=content, reasoning=reasoning)

    def finish_reply(
        self,
        record: MessageRecord,
        status: MessageStatus,
        *,
        content: str,
        reasoning: str,
        tool_calls: list[ToolCall],
        stats: ReplyStats | None,
    ) -> None:
        record.content, record.reasoning, record.status = content, reasoning, status
        record.tool_calls = [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in tool_calls]
        record.stats = stats.to_dict() if stats else {}
        self.store.update_message(
            record.id,
            content=content,
            reasoning=reasoning,
            tool_calls=record.tool_calls,
            status=status,
            stats=record.stats,
        )

    def last_reply(self) -> MessageRecord | None:
        if self.messages and self.messages[-1].role == "assistant":
            return self.messages[-1]
        return None

    def remove_last_reply(self) -> MessageRecord | None:
        """Delete the last assistant message (to generate it again); None if the chat does not end with one."""
        reply = self.last_reply()
        if reply is not None:
            self.store.delete_messages([reply.id])
            self.messages.pop()
        return reply

    def take_last_user_message(self) -> list[MessageRecord]:
        """Delete the last user message and what followed it; return them (the user message first) so its
        text can be edited and sent again. Empty when the chat has no user message."""
        index = next((i for i in range(len(self.messages) - 1, -1, -1) if self.messages[i].role == "user"), None)
        if index is None:
            return []
        removed = self.messages[index:]
        self.store.delete_messages([m.id for m in removed])
        del self.messages[index:]
        return removed

    def image_problems(self) -> list[ImageProblem]:
        """The chat's images that cannot be sent now: those of the last user message are read (as the model
        would), those of earlier ones only looked for (they were read when first sent)."""
        last_user = next((r for r in reversed(self.messages) if r.role == "user"), None)
        problems: list[ImageProblem] = []
        for record in self.messages:
            if record.role != "user":
                continue
            current = record is last_user
            for number, image_id in enumerate(record.images, 1):
                reason = self.images.problem(image_id, read=current)
                if reason is not None:
                    problems.append(ImageProblem(image_id, number, current, reason))
        return problems

    def conversation(self, *, with_images: bool, leave_out: Collection[str] = ()) -> list[Message]:
        """The chat as the model reads it: the system prompt, then every turn that has text, each user
        turn with its images first, in the order they were attached.

        Images are left out unless the model can see them (`with_images`): a prompt must never claim
        an image the model cannot look at. `leave_out`: ids of images not to send (their files are gone).
        """
        messages: list[Message] = []
        if self.options.system_prompt.strip():
            messages.append(Message("system", self.options.system_prompt))
        for record in self.messages:
            if record.role == "user":
                images = [i for i in record.images if i not in leave_out] if with_images else []
                if images:
                    parts: list[TextPart | ImagePart] = [ImagePart(str(self.images.path(i))) for i in images]
                    messages.append(Message("user", [*parts, TextPart(record.content)]))
                else:
                    messages.append(Message("user", record.content))
            elif record.role == "assistant":
                calls = [ToolCall(c["name"], c.get("arguments", {}), c.get("id", "")) for c in record.tool_calls]
                if not record.content and not calls:
                    continue  # a reply that failed or was stopped before writing anything
                messages.append(
                    Message("assistant", record.content, reasoning_content=record.reasoning or None, tool_calls=calls)
                )
        return messages


def make_title(text: str) -> str:
    """A chat title from its first message: the first line, shortened at a word."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "") or "image"
    if len(line) <= _TITLE_LENGTH:
        return line
    cut = line[:_TITLE_LENGTH].rsplit(" ", 1)[0]
    return (cut if len(cut) > _TITLE_LENGTH // 2 else line[:_TITLE_LENGTH]).rstrip(" ,.;:") + "…"
