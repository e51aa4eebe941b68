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
    line, for every model it opens) and the request's projector (picked beside it, or `--mmproj`); without
    one, `open_model` pairs the mmproj file beside the model, if there is one."""
    if request.server is not None:
        return connect(request.server, progress)
    options = dict(options or {})
    if request.projector is not None:
        options["mmproj"] = request.projector
    return (opener or open_model)(request.path, backend=backend, progress=progress, **options)  # type: ignore[arg-type]


def context_limit(model: ChatModel) -> int:
    """Tokens a conversation may hold; 0 when a server does not say."""
    if isinstance(model, RemoteModel):
        return model.context_length
    return model.backend.context_limit


def model_sees_images(model: object) -> bool:
    """Whether the model can look at images (`Model.supports_images`: a projector is loaded and the backend
    reads image rows; a server's model: the server said it reads them). The one place that asks."""
    return bool(getattr(model, "supports_images", False))


def why_no_images(model: object) -> str | None:
    """Why `model` cannot look at images, as one line that names the fix; None when it can (or while no
    model is loaded: whether it will is not known yet)."""
    if model is None or model_sees_images(model):
        return None
    if isinstance(model, RemoteModel):
        return f"the server at {model.server.address} does not say it reads images, so the app sends it none"
    name = getattr(getattr(model, "path", None), "name", None) or "this model"
    if getattr(model, "is_demo", False):
        return "the demo model has no vision projector"
    if getattr(model, "projector_path", None) is None:
        return f"{name} has no vision projector (put its mmproj file beside it, or give --mmproj FILE)"
    backend = getattr(getattr(model, "backend", None), "name", "this")
    return f"the {backend} backend does not read images"
