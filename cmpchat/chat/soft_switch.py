"""The `/think` and `/no_think` soft switches a person may type into a message.

Qwen3 models were trained to obey them as text; Qwen3.5 templates expose thinking only through the
`enable_thinking` variable. So a switch is taken out of the text and turned into that flag. A switch is
a whole word: `/think` in `see /think/notes.md` is a path, not a switch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from cmpchat.chat.messages import Message, TextPart

_SWITCH = re.compile(r"[ \t]*(?<!\S)/(no_think|think)(?!\S)[ \t]*")


def strip_switches(text: str) -> tuple[str, bool | None]:
    """Remove the switches from `text`; also return the last one's meaning (True = think), or None.

    The words on either side of a removed switch stay one space apart; a line left holding only the
    switch loses its spaces, and the whole text is trimmed when anything was removed.
    """
    pieces: list[str] = []
    last: bool | None = None
    position = 0
    for match in _SWITCH.finditer(text):
        last = match.group(1) == "think"
        pieces.append(text[position : match.start()])
        before = "".join(pieces)
        text_before_on_line = before != "" and not before.endswith(("\n", "\r"))
        text_after_on_line = match.end() < len(text) and text[match.end()] not in "\r\n"
        if text_before_on_line and text_after_on_line:
            pieces.append(" ")
        position = match.end()
    if last is None:
        return text, None
    pieces.append(text[position:])
    return "".join(pieces).strip(), last


def apply_switches(messages: Sequence[Message]) -> tuple[list[Message], bool | None]:
    """Strip switches from every system and user message; return the messages and the switch that wins.

    Only the system message and the last user message decide, read in conversation order, so the last
    switch typed in the latest request wins. Switches in older user turns are removed from the text (they
    would only confuse the model) but no longer count.
    """
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    decided: bool | None = None
    cleaned: list[Message] = []
    for index, message in enumerate(messages):
        if message.role not in ("system", "user"):
            cleaned.append(message)
            continue
        message, switch = _strip_message(message)
        if switch is not None and (message.role == "system" or index == last_user):
            decided = switch
        cleaned.append(message)
    return cleaned, decided


def _strip_message(message: Message) -> tuple[Message, bool | None]:
    if isinstance(message.content, str):
        text, switch = strip_switches(message.content)
        return (replace(message, content=text) if switch is not None else message), switch
    parts = []
    decided: bool | None = None
    for part in message.content:
        if isinstance(part, TextPart):
            text, switch = strip_switches(part.text)
            if switch is not None:
                decided = switch
                part = TextPart(text)
        parts.append(part)
    return (replace(message, content=parts) if decided is not None else message), decided
