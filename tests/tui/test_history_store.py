"""The history store, image store and Markdown export, without the app."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from PIL import Image

from cmpchat.errors import CmpchatError
from cmpchat.history import ChatRecord, HistoryStore, ImageStore, chat_to_markdown
from cmpchat.history.store import SCHEMA_VERSION
from cmpchat.tui.session import ChatSession, make_title
from cmpchat.tui.settings import ChatOptions


@pytest.fixture
def store(tmp_path: Path) -> HistoryStore:
    return HistoryStore(tmp_path / "data" / "history.sqlite3")


def test_the_database_is_sqlite_in_wal_mode(store):
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_chats_and_messages_round_trip_newest_chat_first(store):
    first = store.create_chat("first", model="a.gguf", settings={"temperature": 0.2})
    second = store.create_chat("second")
    store.add_message(first.id, "user", "hello", images=["ab.png"])
    reply = store.add_message(first.id, "assistant", status="streaming")
    store.update_message(reply.id, content="hi there", reasoning="why", status="complete", stats={"x": 1.0})
    store.update_message(reply.id, tool_calls=[{"name": "f", "arguments": {}, "id": "c"}])
    assert [c.title for c in store.chats()] == ["first", "second"]  # a message makes a chat recent
    messages = store.messages(first.id)
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("user", "hello", "complete"),
        ("assistant", "hi there", "complete"),
    ]
    assert messages[0].images == ["ab.png"] and messages[1].reasoning == "why" and messages[1].stats == {"x": 1.0}
    assert messages[1].tool_calls[0]["name"] == "f"
    assert store.chat(first.id).settings == {"temperature": 0.2}
    store.rename_chat(second.id, "renamed")
    assert store.chat(second.id).title == "renamed"
    store.delete_chat(first.id)
    assert store.chat(first.id) is None and store.messages(first.id) == []


def test_recover_marks_streaming_replies_interrupted(store):
    chat = store.create_chat("c")
    reply = store.add_message(chat.id, "assistant", "partial", status="streaming")
    assert store.recover_interrupted() == 1
    assert store.messages(chat.id)[0].status == "interrupted"
    assert store.recover_interrupted() == 0
    assert reply.id


def test_a_first_schema_database_gains_reply_models_from_its_chats(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created_at REAL NOT NULL,
            updated_at REAL NOT NULL, model TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '', reasoning TEXT NOT NULL DEFAULT '',
            tool_calls TEXT NOT NULL DEFAULT '[]', images TEXT NOT NULL DEFAULT '[]',
            status TEXT NOT NULL DEFAULT 'complete', stats TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL);
        INSERT INTO chats VALUES (1, 'old chat', 0, 0, 'Qwen3.5-9B-Q8_0.gguf', '{}');
        INSERT INTO messages(chat_id, role, content, created_at) VALUES (1, 'user', 'hi', 0), (1, 'assistant', 'hello', 0);
        PRAGMA user_version=1;
        """
    )
    old.close()
    store = HistoryStore(path)
    assert [(m.role, m.model) for m in store.messages(1)] == [("user", ""), ("assistant", "Qwen3.5-9B-Q8_0.gguf")]
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.add_message(1, "assistant", "again", model="other.gguf")
    store.close()
    assert HistoryStore(path).messages(1)[-1].model == "other.gguf"  # opening it again changes nothing


def test_search_matches_titles_message_words_and_prefixes(store):
    gpu = store.create_chat("GPU shopping")
    trip = store.create_chat("trip plan")
    store.add_message(trip.id, "user", "Which trains run from Zürich to Milano?")
    store.add_message(gpu.id, "assistant", "The CMP 100-210 has HBM2 memory.")
    assert [hit.chat.id for hit in store.search("shopping")] == [gpu.id]
    hits = store.search("zür")
    assert [hit.chat.id for hit in hits] == [trip.id] and "«Zürich»" in hits[0].snippet
    assert [hit.chat.id for hit in store.search('hbm2 "memory')] == [gpu.id]  # quotes are searched, not parsed
    assert store.search("nothing-like-this") == []
    assert len(store.search("")) == 2


def test_search_sees_edits_and_deletions(store):
    chat = store.create_chat("c")
    message = store.add_message(chat.id, "assistant", "alpha")
    store.update_message(message.id, content="beta")
    assert store.search("alpha") == [] and len(store.search("beta")) == 1
    store.delete_messages([message.id])
    assert store.search("beta") == []


def test_images_are_stored_once_by_content(tmp_path):
    images = ImageStore(tmp_path / "images")
    source = tmp_path / "a.png"
    Image.new("RGB", (4, 3), "green").save(source)
    copy = tmp_path / "b.png"
    copy.write_bytes(source.read_bytes())
    first, second = images.add(source), images.add(copy)
    assert first.id == second.id and first.id.endswith(".png") and (first.width, first.height) == (4, 3)
    assert first.path.read_bytes() == source.read_bytes()
    assert len(list((tmp_path / "images").rglob("*"))) == 2  # one folder, one file
    assert images.get(first.id) == first
    first.path.unlink()
    assert images.get(first.id) is None


def test_images_refuse_what_is_not_an_image(tmp_path):
    images = ImageStore(tmp_path / "images")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(CmpchatError, match="not an image"):
        images.add(text)
    with pytest.raises(CmpchatError, match="cannot read"):
        images.add(tmp_path / "missing.png")
    with pytest.raises(CmpchatError):
        images.path("../../etc/passwd")


def test_export_to_markdown(store, tmp_path):
    chat = store.create_chat("Delta rule", model="q.gguf", settings={"system_prompt": "Be brief."})
    store.add_message(chat.id, "user", "Explain", images=["aa11.png"])
    reply = store.add_message(chat.id, "assistant", "It **writes** errors.", reasoning="think", status="stopped")
    store.update_message(reply.id, stats={"reasoning_seconds": 3.1}, tool_calls=[{"name": "f", "arguments": {"a": 1}}])
    text = chat_to_markdown(store.chat(chat.id), store.messages(chat.id), lambda i: tmp_path / i)
    assert text.startswith("# Delta rule\n")
    assert "## System\n\nBe brief." in text
    assert f"![image]({(tmp_path / 'aa11.png').as_posix()})" in text
    assert "<summary>Thought for 3.1 s</summary>" in text and "It **writes** errors." in text
    assert "**Tool call** `f`" in text and '"a": 1' in text
    assert "_(stopped by the user)_" in text


def test_session_builds_the_conversation_the_model_reads(store, tmp_path):
    images = ImageStore(tmp_path / "images")
    session = ChatSession(store, images, ChatOptions(system_prompt="sys"))
    session.add_user_message("first question", [])
    reply = session.start_reply("m.gguf")
    session.finish_reply(reply, "complete", content="answer", reasoning="r", tool_calls=[], stats=None)
    session.add_user_message("second", ["ab.png"])
    empty = session.start_reply("other.gguf")
    session.finish_reply(empty, "error", content="", reasoning="", tool_calls=[], stats=None)
    messages = session.conversation(with_images=False)
    assert [(m.role, m.text) for m in messages] == [
        ("system", "sys"),
        ("user", "first question"),
        ("assistant", "answer"),
        ("user", "second"),
    ]
    assert messages[2].reasoning_content == "r" and messages[3].images == []
    with_images = session.conversation(with_images=True)
    assert with_images[3].images[0].ref.endswith("ab.png")
    assert session.chat is not None and session.chat.title == "first question"
    reopened = ChatSession.open(store, images, ChatOptions(), session.chat.id)
    assert reopened is not None and reopened.options.system_prompt == "sys"
    assert [m.id for m in reopened.messages] == [m.id for m in session.messages]
    assert [m.model for m in reopened.messages] == ["", "m.gguf", "", "other.gguf"]
    assert reopened.chat is not None and reopened.chat.model == "other.gguf"  # the model it last used
    removed = session.take_last_user_message()
    assert [m.role for m in removed] == ["user", "assistant"] and len(store.messages(session.chat.id)) == 2


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("  \n Explain the delta rule \nplease", "Explain the delta rule"),
        ("", "image"),
    ],
)
def test_titles_come_from_the_first_line(text, title):
    assert make_title(text) == title


def test_long_titles_are_cut_at_a_word():
    title = make_title("word " * 30)
    assert title.endswith("…") and len(title) <= 49 and ("word " * 30).startswith(title[:-1])
    assert not title[:-1].endswith(" ")


def test_chat_record_defaults():
    assert ChatRecord(1, "t", 0.0, 0.0).settings == {}
