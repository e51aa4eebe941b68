"""Chat history on disk: chats and messages in SQLite, attached images stored once by content hash.

Front ends (the terminal app, later the server) share it; nothing here knows about Textual.
"""

from cmpchat.history.export import chat_to_markdown
from cmpchat.history.images import ImageStore, StoredImage
from cmpchat.history.store import ChatRecord, HistoryStore, MessageRecord, MessageStatus, SearchHit

__all__ = [
    "ChatRecord",
    "HistoryStore",
    "ImageStore",
    "MessageRecord",
    "MessageStatus",
    "SearchHit",
    "StoredImage",
    "chat_to_markdown",
]
