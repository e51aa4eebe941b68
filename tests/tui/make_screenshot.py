"""Regenerate docs/app.svg, the README's picture of the app: the real app on the demo model and the CPU backend,
after one short exchange, at 100×30.

    .venv/bin/python -m tests.tui.make_screenshot [OUT.svg]

Nothing is staged: the demo model (built in the cache folder on first use) writes the reply through the real
engine, greedily, so its random text is the same from run to run; the speeds are this machine's, and the GPU
readings too (none on a machine without an NVIDIA driver). History and state go to a temporary folder, not
yours. Not a test: pytest does not collect this file.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from cmpchat.history.images import ImageStore
from cmpchat.history.store import HistoryStore
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.model_request import ModelRequest
from cmpchat.tui.settings import AppState, Settings
from cmpchat.tui.widgets.prompt import PromptArea
from tests.tui.helpers import chat_screen, send, wait_for

SIZE = (100, 30)
OUT = Path(__file__).resolve().parents[2] / "docs" / "app.svg"
MESSAGE = "Hello! What can you do?"


async def make_screenshot(out: Path) -> Path:
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder)
        app = CmpchatApp(
            model_request=ModelRequest(None),  # the demo model
            settings=Settings(backend="cpu", temperature=0.0, max_tokens=48, thinking=False),
            state=AppState(),
            state_file=data / "state.json",
            history=HistoryStore(data / "history.sqlite3"),
            images=ImageStore(data / "images"),
            discover=lambda: [],
        )
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            # Building the demo model the first time takes a minute or two.
            await wait_for(pilot, lambda: app.model is not None, timeout=600, what="the demo model")
            screen = chat_screen(pilot)
            await send(pilot, MESSAGE, wait=False)
            await wait_for(pilot, lambda: not screen.generating, timeout=120, what="the reply")
            await pilot.pause()
            app.screen.query_one(PromptArea).cursor_blink = False
            await pilot.pause(0.2)
            saved = app.save_screenshot(out.name, str(out.parent))
    return Path(saved)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    print(f"saved {asyncio.run(make_screenshot(out))}")


if __name__ == "__main__":
    main()
