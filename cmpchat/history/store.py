"""Chats and their messages in one SQLite file (WAL), with full-text search over titles and messages.

A reply is written while it streams (status "streaming") and finished in place, so a process killed
mid-reply leaves its text behind; the next start marks such rows "interrupted". One connection per
store, used from one thread (the app's event loop); SQLite refuses use from another thread.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

from cmpchat.chat.messages import Role

MessageStatus: TypeAlias = Literal["complete", "streaming", "stopped", "interrupted", "error"]
"""complete: the model ended it; streaming: being written now (or the writer died); stopped: the person
stopped it; interrupted: the app ended while it streamed, or a server's stream broke (remote mode); error:
generation failed."""

SCHEMA_VERSION = 2
"""1: the first schema; 2: messages.model (the model that wrote a reply)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    tool_calls TEXT NOT NULL DEFAULT '[]',
    images TEXT NOT NULL DEFAULT '[]',
    status TEXT NOT NULL DEFAULT 'complete',
    stats TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    model TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content, reasoning, content='messages', content_rowid='id', tokenize='unicode61'
);
CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, reasoning) VALUES ('delete', old.id, old.content, old.reasoning);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content, reasoning ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, reasoning) VALUES ('delete', old.id, old.content, old.reasoning);
    INSERT INTO messages_fts(rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
"""


@dataclass(slots=True)
class ChatRecord:
    """One conversation; `settings` holds its own system prompt and sampling, as the front end stores them."""

    id: int
    title: str
    created_at: float
    updated_at: float
    model: str = ""
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class MessageRecord:
    """One stored turn. `images` are ids in the `ImageStore`; `stats` the reply's timings; `model` the model
    that wrote a reply (as the front end names it), empty for the person's messages."""

    id: int
    chat_id: int
    role: Role
    content: str
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    status: MessageStatus = "complete"
    stats: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    model: str = ""


@dataclass(frozen=True, slots=True)
class SearchHit:
    """A chat matching a search, with a piece of the matching text (empty when the title matched)."""

    chat: ChatRecord
    snippet: str


class HistoryStore:
    """The history database at `path` (created with its folder on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode syncs at checkpoints only: a crash loses no committed row, a power cut
        # may lose the last ones; streamed replies are written many times a second, so this matters.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _migrate(self) -> None:
        """Bring a database written by an older schema up to this one."""
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(messages)")}
        if "model" not in columns:  # schema 1: replies did not record their model; the chat's is the best guess
            with self._transaction():
                self._db.execute("ALTER TABLE messages ADD COLUMN model TEXT NOT NULL DEFAULT ''")
                self._db.execute(
                    "UPDATE messages SET model=(SELECT model FROM chats WHERE chats.id=messages.chat_id)"
                    " WHERE role='assistant'"
                )

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def recover_interrupted(self) -> int:
        """Mark replies left "streaming" by a process that died as "interrupted"; return how many."""
        return self._db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'").rowcount

    # -- chats ------------------------------------------------------------------------------------

    def create_chat(self, title: str, *, model: str = "", settings: dict[str, Any] | None = None) -> ChatRecord:
        now = time.time()
        settings = settings or {}
        cursor = self._db.execute(
            "INSERT INTO chats(title, created_at, updated_at, model, settings) VALUES (?, ?, ?, ?, ?)",
            (title, now, now, model, json.dumps(settings)),
        )
        return ChatRecord(int(cursor.lastrowid or 0), title, now, now, model, dict(settings))

    def chats(self) -> list[ChatRecord]:
        """All chats, the most recently used first."""
        rows = self._db.execute("SELECT * FROM chats ORDER BY updated_at DESC, id DESC")
        return [_chat(row) for row in rows]

    def chat(self, chat_id: int) -> ChatRecord | None:
        row = self._db.execute("SELECT * FROM chats WHERE id=?", (chat_id,)).fetchone()
        return _chat(row) if row else None

    def rename_chat(self, chat_id: int, title: str) -> None:
        self._db.execute("UPDATE chats SET title=? WHERE id=?", (title, chat_id))

    def update_chat(self, chat_id: int, *, model: str | None = None, settings: dict[str, Any] | None = None) -> None:
        if model is not None:
            self._db.execute("UPDATE chats SET model=? WHERE id=?", (model, chat_id))
        if settings is not None:
            self._db.execute("UPDATE chats SET settings=? WHERE id=?", (json.dumps(settings), chat_id))

    def delete_chat(self, chat_id: int) -> None:
        self._db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    # -- messages ---------------------------------------------------------------------------------

    def add_message(
        self,
        chat_id: int,
        role: Role,
        content: str = "",
        *,
        reasoning: str = "",
        images: Sequence[str] = (),
        status: MessageStatus = "complete",
        model: str = "",
    ) -> MessageRecord:
        now = time.time()
        with self._transaction():
            cursor = self._db.execute(
                "INSERT INTO messages(chat_id, role, content, reasoning, images, status, created_at, model)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, reasoning, json.dumps(list(images)), status, now, model),
            )
            self._db.execute("UPDATE chats SET updated_at=? WHERE id=?", (now, chat_id))
        return MessageRecord(
            int(cursor.lastrowid or 0), chat_id, role, content, reasoning, [], list(images), status, {}, now, model
        )

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        status: MessageStatus | None = None,
        stats: dict[str, float] | None = None,
    ) -> None:
        """Change the given fields of a message; the others stay as they are."""
        columns: dict[str, Any] = {}
        if content is not None:
            columns["content"] = content
        if reasoning is not None:
            columns["reasoning"] = reasoning
        if tool_calls is not None:
            columns["tool_calls"] = json.dumps(tool_calls)
        if status is not None:
            columns["status"] = status
        if stats is not None:
            columns["stats"] = json.dumps(stats)
        if columns:
            assignments = ", ".join(f"{name}=?" for name in columns)
            self._db.execute(f"UPDATE messages SET {assignments} WHERE id=?", (*columns.values(), message_id))

    def messages(self, chat_id: int) -> list[MessageRecord]:
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id=? ORDER BY id", (chat_id,))
        return [_message(row) for row in rows]

    def delete_messages(self, message_ids: Iterable[int]) -> None:
        ids = list(message_ids)
        with self._transaction():
            self._db.executemany("DELETE FROM messages WHERE id=?", [(i,) for i in ids])

    # -- search -----------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Chats whose title or messages contain every word of `text` (the last word as a prefix)."""
        query = _fts_query(text)
        if not query:
            return [SearchHit(chat, "") for chat in self.chats()[:limit]]
        hits: dict[int, SearchHit] = {}
        like = f"%{text.strip()}%"
        for row in self._db.execute(
            "SELECT * FROM chats WHERE title LIKE ? ORDER BY updated_at DESC LIMIT ?", (like, limit)
        ):
            chat = _chat(row)
            hits[chat.id] = SearchHit(chat, "")
        rows = self._db.execute(
            "SELECT c.*, snippet(messages_fts, -1, '«', '»', '…', 8) AS snippet"
            " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid JOIN chats c ON c.id = m.chat_id"
            " WHERE messages_fts MATCH ? ORDER BY c.updated_at DESC, rank LIMIT ?",
            (query, limit * 4),
        )
        for row in rows:
            chat = _chat(row)
            if chat.id not in hits:
                hits[chat.id] = SearchHit(chat, " ".join(row["snippet"].split()))
        return sorted(hits.values(), key=lambda hit: hit.chat.updated_at, reverse=True)[:limit]


def _fts_query(text: str) -> str:
    # Each word quoted, so punctuation a person types is searched for rather than parsed as FTS syntax.
    words = [word.replace('"', '""') for word in text.split()]
    if not words:
        return ""
    quoted = [f'"{word}"' for word in words]
    quoted[-1] += "*"
    return " ".join(quoted)


def _chat(row: sqlite3.Row) -> ChatRecord:
    return ChatRecord(
        id=row["id"],
        title=row["title"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        model=row["model"],
        settings=json.loads(row["settings"]),
    )


def _message(row: sqlite3.Row) -> MessageRecord:
    return MessageRecord(
        id=row["id"],
        chat_id=row["chat_id"],
        role=row["role"],
        content=row["content"],
        reasoning=row["reasoning"],
        tool_calls=json.loads(row["tool_calls"]),
        images=json.loads(row["images"]),
        status=row["status"],
        stats=json.loads(row["stats"]),
        created_at=row["created_at"],
        model=row["model"],
    )
