"""The one exception type users see.

Anything a user can cause (a wrong file, an unsupported model, a bad request) raises `CmpchatError`
with a message that fits on one line and says what happened and what to do. Front ends print the
message alone, never a traceback.
"""


class CmpchatError(Exception):
    """A problem the user can fix; `str(err)` is the whole message."""
