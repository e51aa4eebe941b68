"""Which request holds which of the engine's slots, as the server sees it from the events it reads (for /slots and
/v1/cmpchat/gpus).

A request takes the lowest free slot when its `Started` event is read and gives it back with its last event, or
when it is cancelled; one that the engine preempts keeps its row while it waits to resume. Everything here runs on
the event loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from cmpchat.engine.reply import GenerationOptions


@dataclass(eq=False, slots=True)
class SlotHolder:
    """A request that holds a slot, and what it has generated so far."""

    task: int
    """The engine's id of the request."""
    options: GenerationOptions
    generated: int = 0
    decoding: bool = False
    """Whether it has generated a token (before that it is reading its prompt)."""
    new_line: bool = False
    """Whether its text so far has a line break."""


class SlotTable:
    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._holders: list[SlotHolder | None] = [None] * slots

    def take(self, holder: SlotHolder) -> None:
        if None in self._holders:
            self._holders[self._holders.index(None)] = holder
        else:
            # The engine has freed a slot whose holder's last event is not read yet: show one row more meanwhile.
            self._holders.append(holder)

    def give_back(self, holder: SlotHolder) -> None:
        if holder in self._holders:
            self._holders[self._holders.index(holder)] = None
        while len(self._holders) > self._slots and self._holders[-1] is None:
            self._holders.pop()

    def holders(self) -> list[SlotHolder | None]:
        """Each slot's holder in slot order, None for a free slot."""
        return list(self._holders)
