"""The app's settings (a TOML file the person edits), a chat's own options, and what the app remembers.

`config.toml` in `cmpchat.paths.config_dir()`; every key is optional:

    theme = "cmpchat-light"
    thinking = false
    temperature = 0.6
    model_dirs = ["/data/gguf"]

    [keymap]            # binding id = keys (see F1 for the ids)
    "chat.export" = "ctrl+x,f10"

What the app remembers by itself (the last model, the theme picked in the palette, the thinking
toggle) lives in `state.json` in the data folder, so the person's file is never rewritten.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from cmpchat.engine.reply import GenerationOptions
from cmpchat.paths import config_dir, data_dir
from cmpchat.sampling import SamplingParams


@dataclass(slots=True)
class Settings:
    """Settings read from `config.toml`; the docstring under each field is its documentation."""

    theme: str = "cmpchat-dark"
    """Theme at start: a file name in `themes/` or in `<config>/themes/` without `.toml`. A theme picked in
    the command palette is remembered and wins over this."""
    thinking: bool = True
    """Whether replies start with reasoning (for models whose template supports it). Ctrl+T flips it for
    the following turns; `/think` or `/no_think` typed in a message decides that one turn."""
    system_prompt: str = ""
    """System prompt of new chats; each chat can change its own (Ctrl+S)."""
    temperature: float = 0.7
    """Sampling temperature of new chats; 0 = greedy."""
    top_p: float = 0.8
    """Nucleus sampling threshold of new chats (1 = off)."""
    top_k: int = 20
    """Sample among the k likeliest tokens in new chats (0 = all)."""
    max_tokens: int = 4096
    """Most tokens per reply in new chats."""
    backend: str = "auto"
    """Compute backend: "auto" (CUDA when an NVIDIA GPU is usable), "cuda" or "cpu"."""
    model_dirs: list[str] = field(default_factory=list)
    """More folders to search for GGUF files, besides the llama.cpp, Hugging Face and LM Studio caches and ~/models."""
    gpu_sample_seconds: float = 1.0
    """Seconds between GPU readings (0.5 to 1)."""
    refresh_hz: float = 30.0
    """How often streamed text and speeds reach the screen (5 to 60 times a second); the engine never waits on it."""
    show_chat_list: bool = True
    """Show the chat list at the left on wide terminals (F2 toggles it)."""
    keymap: dict[str, str] = field(default_factory=dict)
    """Key overrides: binding id to keys, e.g. {"chat.export" = "ctrl+x,f10"}. F1 lists the ids."""

    def __post_init__(self) -> None:
        self.gpu_sample_seconds = min(max(self.gpu_sample_seconds, 0.5), 1.0)
        self.refresh_hz = min(max(self.refresh_hz, 5.0), 60.0)

    def chat_options(self) -> ChatOptions:
        """The options a new chat starts with."""
        return ChatOptions(self.system_prompt, self.temperature, self.top_p, self.top_k, self.max_tokens)


def settings_path() -> Path:
    return config_dir() / "config.toml"


def load_settings(path: Path | None = None) -> tuple[Settings, list[str]]:
    """The settings in `path` (default `settings_path()`), and a line for each problem found in it.

    A missing file gives the defaults; a key that is unknown or of the wrong type is ignored and reported.
    """
    path = path or settings_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Settings(), []
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        return Settings(), [f"{path}: {err}; using the default settings"]
    return _from_dict(Settings, data, str(path))


@dataclass(slots=True)
class ChatOptions:
    """One chat's system prompt and sampling, stored with the chat and edited in its settings dialog."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_tokens: int = 4096
    seed: int | None = None

    def generation_options(self) -> GenerationOptions:
        sampling = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
        return GenerationOptions(sampling=sampling, max_tokens=self.max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: ChatOptions | None = None) -> ChatOptions:
        base = asdict(defaults or cls())
        base.update({key: value for key, value in data.items() if key in base})
        options, _ = _from_dict(cls, base, "chat settings")
        return options


@dataclass(slots=True)
class AppState:
    """What the app remembers between runs by itself."""

    last_model: str | None = None
    """Path of the model used last; "" for the demo model; None when nothing was loaded yet."""
    theme: str | None = None
    """The theme picked in the command palette."""
    thinking: bool | None = None
    """The thinking toggle as it was left."""
    last_chat: int | None = None
    """The chat open when the app ended."""


def state_path() -> Path:
    return data_dir() / "state.json"


def load_state(path: Path | None = None) -> AppState:
    path = path or state_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return AppState()
    state, _ = _from_dict(AppState, data if isinstance(data, dict) else {}, str(path))
    return state


def save_state(state: AppState, path: Path | None = None) -> None:
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(state), indent=2), encoding="utf-8")
    temporary.replace(path)


T = TypeVar("T")

_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "float": (int, float),
    "int": (int,),
    "list[str]": (list,),
    "dict[str, str]": (dict,),
    "str | None": (str, type(None)),
    "bool | None": (bool, type(None)),
    "int | None": (int, type(None)),
}


def _from_dict(cls: type[T], data: dict[str, Any], where: str) -> tuple[T, list[str]]:
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key not in known:
            problems.append(f"{where}: unknown setting '{key}' (ignored)")
            continue
        allowed = _TYPES.get(str(known[key].type), (object,))
        # bool is an int in Python; a `true` where a number belongs is a mistake worth reporting.
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            problems.append(f"{where}: '{key}' should be {known[key].type}, not {value!r} (ignored)")
            continue
        values[key] = value
    try:
        return cls(**values), problems
    except (TypeError, ValueError) as err:
        return cls(), [*problems, f"{where}: {err}; using the defaults"]
