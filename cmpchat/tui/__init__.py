"""The `cmpchat` terminal app (Textual): chats with history, streaming replies, live speed and GPU panels.

Layout by screen region: `widgets/` holds the pieces of the main screen, `screens/` the main screen and
its dialogs, `app.py` the application (model loading, themes, keys, GPU monitor). The engine is used
only through `cmpchat.engine.Model`; nothing below the front-end layer knows this package exists.
"""

from cmpchat.tui.app import CmpchatApp, ModelRequest

__all__ = ["CmpchatApp", "ModelRequest"]
