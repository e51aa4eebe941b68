"""Engine configurations written as `key=value,key=value` (`cmpchat eval --base ... --test ...`).

Each key is one `EngineKey`: how its value is parsed and which `open_model` argument it sets (the key
`model` picks another file instead). New engine options (sparse prefill, say) become new keys with
`register_key`, as the KV-cache format (`kv`) did, and every front end that takes a spec accepts them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmpchat.errors import CmpchatError
from cmpchat.kv_formats import BASELINES, FORMATS


@dataclass(frozen=True, slots=True)
class EngineKey:
    name: str
    parse: Callable[[str], Any]
    help: str
    argument: str | None = None
    """The `open_model` keyword this key sets (None: handled by EngineSpec itself, as `model` is)."""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 0 or 1")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("expected a positive whole number")
    return value


def _size(text: str) -> int:
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    number, unit = text.strip().lower().rstrip("ib").rstrip(), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    value = float(number) * units[unit]
    if value <= 0:
        raise ValueError("expected a size such as 16G")
    return int(value)


KEYS: dict[str, EngineKey] = {}


def register_key(key: EngineKey) -> None:
    """Make `key` usable in every spec; a name may be registered once."""
    if key.name in KEYS:
        raise ValueError(f"engine spec key {key.name!r} is already registered")
    KEYS[key.name] = key


for _key in (
    EngineKey("model", str, "another GGUF file (same vocabulary)"),
    EngineKey("backend", _choice("auto", "cpu", "cuda"), "auto, cpu (numpy reference) or cuda", "backend"),
    EngineKey("mirror_gpu", _bool, "1: the CPU reference rounds as the GPU engine does", "mirror_gpu"),
    EngineKey("context", _positive_int, "most tokens per sequence (GPU)", "context"),
    EngineKey("gpu_mem", _size, "GPU memory to plan with, e.g. 16G", "gpu_mem"),
    EngineKey("graphs", _bool, "0: launch GPU kernels one by one", "use_graphs"),
    EngineKey(
        "kv",
        _choice(*FORMATS, *BASELINES),
        f"KV cache format: {', '.join(FORMATS)}; {', '.join(BASELINES)} are measurement baselines (CPU only)",
        "kv",
    ),
):
    register_key(_key)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine configuration: a model file and the `open_model` arguments to open it with."""

    text: str
    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        values: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep:
                raise CmpchatError(f"engine spec '{text}': '{item}' is not key=value (keys: {', '.join(KEYS)})")
            if name not in KEYS:
                raise CmpchatError(f"engine spec '{text}': unknown key '{name}' (keys: {', '.join(KEYS)})")
            if name in values:
                raise CmpchatError(f"engine spec '{text}': '{name}' is given twice")
            try:
                values[name] = KEYS[name].parse(raw.strip())
            except ValueError as err:
                raise CmpchatError(f"engine spec '{text}': bad value '{raw.strip()}' for {name}: {err}") from None
        return cls(text, values)

    def model_path(self, default: str | Path) -> Path:
        return Path(self.values.get("model", default))

    def open_arguments(self) -> dict[str, Any]:
        return {argument: v for n, v in self.values.items() if (argument := KEYS[n].argument) is not None}

    def describe(self) -> str:
        return self.text or "defaults"


def keys_help() -> str:
    return "; ".join(f"{k.name}: {k.help}" for k in KEYS.values())
