"""Running a slash command on the chat screen: each is one of the screen's actions, or (/system TEXT,
/temp VALUE) the change that action's dialog would make. Every refusal is one line."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cmpchat.tui.slash_commands import CommandCall, command_list

if TYPE_CHECKING:
    from cmpchat.tui.screens.chat_screen import ChatScreen


async def run_command(screen: ChatScreen, call: CommandCall) -> bool:
    """Run `call`; False when it was refused (the screen gives the text back to the prompt)."""
    command = call.command
    if command is None:
        screen.notify(
            f"/{call.name} is not a command; the commands are {command_list()} (start with // to send a /)",
            severity="warning",
        )
        return False
    if call.argument and command.name == "system":
        screen.session.set_options(replace(screen.session.options, system_prompt=call.argument))
        screen.notify("System prompt set; it applies from the next reply.", timeout=2)
        return True
    if call.argument and command.name == "temp":
        return _set_temperature(screen, call.argument)
    if call.argument:
        screen.notify(f"/{command.name} takes nothing after it.", severity="warning")
        return False
    if not screen.check_action(command.action, ()):
        screen.notify("Stop the reply first (Esc).", severity="warning")
        return False
    await screen.run_action(command.action)
    return True


def _set_temperature(screen: ChatScreen, value: str) -> bool:
    try:
        options = replace(screen.session.options, temperature=float(value))
    except ValueError:
        screen.notify(f"/temp {value}: the temperature is a number (0 = greedy)", severity="warning")
        return False
    try:
        options.generation_options()  # raises ValueError with the engine's own wording for a bad value
    except ValueError as err:
        screen.notify(f"/temp {value}: {err}", severity="warning")
        return False
    screen.session.set_options(options)
    screen.notify(f"Temperature {options.temperature:g} from the next reply.", timeout=2)
    return True
