"""Which model to open (a file, the demo model, or one on a server), and opening it with progress reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from cmpchat.api import Model, open_model
from cmpchat.tui.remote_model import RemoteModel, RemoteServer, connect

ChatModel: TypeAlias = Model | RemoteModel
"""What the app chats with: a model it runs itself, or one behind an OpenAI-compatible server."""


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """A model file to open (None: the demo model) and the vision projector found beside it, if any; or,
    with `server`, the model on that server instead."""

    path: Path | None = None
    projector: Path | None = None
    server: RemoteServer | None = None

    @property
    def label(self) -> str:
        if self.server is not None:
            return self.server.url
        return "the demo model" if self.path is None else self.path.name

    @property
    def remembered(self) -> str:
        """How `AppState.last_model` records it: the path, or "" for the demo model."""
        return "" if self.path is None else str(self.path)

    @classmethod
    def from_remembered(cls, value: str) -> ModelRequest:
        return cls(None if value == "" else Path(value))


class ModelOpener(Protocol):
    """`cmpchat.open_model`'s shape; tests pass a stand-in that returns a scripted model."""

    def __call__(
        self, path: Path | None, *, backend: str, progress: Callable[[str, int, int], None], **options: Any
    ) -> Model: ...


def open_requested(
    request: ModelRequest,
    backend: str,
    progress: Callable[[str, int, int], None],
    opener: ModelOpener | None = None,
    options: dict[str, Any] | None = None,
) -> ChatModel:
    """Open the requested model with `open_model`'s layout `options` (`--gpus`, `--ctx`...: the app's command
    line, for every model it opens); the projector is not used yet (the app attaches no images to the engine)."""
    if request.server is not None:
        return connect(request.server, progress)
    return (opener or open_model)(request.path, backend=backend, progress=progress, **(options or {}))  # type: ignore[arg-type]


def context_limit(model: ChatModel) -> int:
    """Tokens a conversation may hold; 0 when a server does not say."""
    if isinstance(model, RemoteModel):
        return model.context_length
    return model.backend.context_limit


def model_sees_images(model: object) -> bool:
    """Whether the model can look at images. The engine has no vision projector support yet; when it
    has, `Model.supports_images` will say so, and this is the one place that asks."""
    return bool(getattr(model, "supports_images", False))
