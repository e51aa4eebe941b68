"""App tests run on a private folder (history, images, state), fake GPUs and, where speed and exact
output matter, a scripted model; `real_app` runs the tiny random model through the real engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cmpchat.gpu_readings import FakeGpuSampler
from cmpchat.history.images import ImageStore
from cmpchat.history.store import HistoryStore
from cmpchat.tui.app import CmpchatApp
from cmpchat.tui.model_request import ModelOpener, ModelRequest
from cmpchat.tui.settings import AppState, Settings
from tests.tui.fakes import ScriptedModel, scripted_opener

AppFactory = Callable[..., CmpchatApp]


@pytest.fixture
def make_app(tmp_path: Path) -> AppFactory:
    """Builds apps sharing one history folder, so a second app sees what the first one stored."""

    def make(
        model: ScriptedModel | None = None,
        *,
        model_path: Path | None = None,
        settings: Settings | None = None,
        state: AppState | None = None,
        fresh_state: bool = True,
        gpus: int = 2,
        discover=None,
        opener: ModelOpener | None = None,
    ) -> CmpchatApp:
        """`opener`, when given, opens the model instead of handing `model` over at once."""
        scripted = model
        if opener is None and scripted is not None:
            opener = scripted_opener(lambda path: scripted)
        request = ModelRequest(model_path or (scripted.path if scripted else None))
        return CmpchatApp(
            model_request=request,
            settings=settings or Settings(),
            state=state or (AppState() if fresh_state else None),
            state_file=tmp_path / "state.json",
            history=HistoryStore(tmp_path / "history.sqlite3"),
            images=ImageStore(tmp_path / "images"),
            gpu_sampler=FakeGpuSampler(gpus),
            discover=discover or (lambda: []),
            opener=opener,
        )

    return make
