"""Slash commands typed in the prompt (`/temp 0.2`, `/new`, ...): which exist, telling a command from a
message, and the completion shown while a command's name is typed. No Textual here; the chat screen runs
them (`screens/slash_flows.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlashCommand:
    name: str
    argument: str
    """What follows the name, as the person reads it ("TEXT"); "" when it takes nothing."""
    description: str
    action: str
    """The chat screen's action it runs (for /system and /temp: only without an argument)."""


COMMANDS = (
    SlashCommand("system", "TEXT", "this chat's system prompt (alone: the settings dialog)", "chat_settings"),
    SlashCommand("temp", "VALUE", "this chat's sampling temperature (alone: the settings dialog)", "chat_settings"),
    SlashCommand("model", "", "choose another model", "pick_model"),
    SlashCommand("new", "", "start a new chat", "new_chat"),
    SlashCommand("export", "", "export this chat to Markdown", "export"),
    SlashCommand("clear", "", "an empty conversation (a new chat; this one stays in the list)", "new_chat"),
)
BY_NAME = {command.name: command for command in COMMANDS}
MODEL_SWITCHES = ("/think", "/no_think")
"""Qwen's own switches at the start of a message: they are part of the message, not commands."""


@dataclass(frozen=True, slots=True)
class CommandCall:
    """A command as typed: its name (known or not) and the text after it."""

    name: str
    argument: str

    @property
    def command(self) -> SlashCommand | None:
        return BY_NAME.get(self.name)


def parse(text: str) -> CommandCall | str:
    """A command call, or the message to send: `//…` sends `/…`, and Qwen's `/think` and `/no_think` are
    sent as written."""
    if text.startswith("//"):
        return text[1:]
    if not text.startswith("/") or text.split(maxsplit=1)[0] in MODEL_SWITCHES:
        return text
    rest = text[1:]
    name = rest.split(maxsplit=1)[0] if rest[:1].strip() else ""  # "/" then a space: no name, not a command
    return CommandCall(name, rest[len(name) :].strip())


def completion(text: str) -> str:
    """What Tab adds to `text` while it is a command's name being typed ("/te" -> "mp "); "" otherwise."""
    if not text.startswith("/") or text.startswith("//") or any(c.isspace() for c in text):
        return ""
    typed = text[1:]
    for command in COMMANDS:
        if command.name.startswith(typed) and command.name != typed:
            return command.name[len(typed) :] + (" " if command.argument else "")
    return ""


def command_list() -> str:
    """ "/system TEXT, /temp VALUE, /model, ..." for the lines that name them."""
    return ", ".join(f"/{c.name} {c.argument}".rstrip() for c in COMMANDS)
