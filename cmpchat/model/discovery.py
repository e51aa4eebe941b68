"""Finding GGUF models already on the machine: llama.cpp's cache, the Hugging Face hub cache, LM Studio's
folders, `~/models`, and folders the user configured.

Only the first few metadata keys of each file are read (architecture, name), so a folder of 27B files
is listed in milliseconds. A vision projector (`mmproj*.gguf`, or a file whose metadata says it is
one) is paired with the models in its folder rather than listed as a model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from cmpchat.model.config import ARCHITECTURE
from cmpchat.model.gguf_parse import read_scalar_metadata

_MAX_DEPTH = 6
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_PROJECTOR_ARCHITECTURES = frozenset({"clip", "mmproj"})


@dataclass(frozen=True, slots=True)
class SearchRoot:
    """A folder to look in, and what to call it in the picker."""

    label: str
    path: Path


@dataclass(frozen=True, slots=True)
class FoundModel:
    """A GGUF model file on disk and what its header says."""

    path: Path
    size: int
    source: str
    """Which search root it was found under (e.g. "Hugging Face cache")."""
    name: str
    """`general.name` from the file, else the file name without `.gguf`."""
    architecture: str
    projector: Path | None = None
    """A vision projector lying beside the model, if any."""

    @property
    def supported(self) -> bool:
        """Whether cmpchat can run it (dense Qwen3.5 / Qwen3.6)."""
        return self.architecture == ARCHITECTURE


def default_roots(extra: Iterable[str | Path] = ()) -> list[SearchRoot]:
    """The usual places models are kept, then `extra` folders (from the settings); missing ones included."""
    home = Path.home()
    env = os.environ
    llama_cache = env.get("LLAMA_CACHE") or platformdirs.user_cache_dir("llama.cpp")
    hf_home = env.get("HF_HOME") or str(Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "huggingface")
    hf_hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or str(Path(hf_home) / "hub")
    roots = [
        SearchRoot("llama.cpp cache", Path(llama_cache)),
        SearchRoot("Hugging Face cache", Path(hf_hub)),
        SearchRoot("LM Studio", home / ".lmstudio" / "models"),
        SearchRoot("LM Studio", home / ".cache" / "lm-studio" / "models"),
        SearchRoot("~/models", home / "models"),
    ]
    roots += [SearchRoot("settings", Path(folder).expanduser()) for folder in extra]
    return roots


def find_models(roots: Sequence[SearchRoot] | None = None) -> list[FoundModel]:
    """Every GGUF model under `roots` (default: `default_roots()`), supported ones first, then by name.

    Split models are listed once, by their first part; unreadable files and folders are skipped.
    """
    found: dict[Path, FoundModel] = {}
    for root in default_roots() if roots is None else roots:
        for folder, files in _walk(root.path):
            models: list[tuple[Path, dict[str, object]]] = []
            projectors: list[Path] = []
            for file_name in files:
                if not file_name.lower().endswith(".gguf"):
                    continue
                shard = _SHARD.search(file_name)
                if shard and int(shard.group(1)) != 1:
                    continue
                path = folder / file_name
                header = read_scalar_metadata(path)
                if header is None:
                    continue
                if _is_projector(file_name, header):
                    projectors.append(path)
                else:
                    models.append((path, header))
            for path, header in models:
                resolved = path.resolve()
                if resolved in found:
                    continue
                found[resolved] = FoundModel(
                    path=path,
                    size=_size(resolved),
                    source=root.label,
                    name=str(header.get("general.name") or path.name.removesuffix(".gguf")),
                    architecture=str(header.get("general.architecture", "")),
                    projector=_pick_projector(path, projectors),
                )
    return sorted(found.values(), key=lambda model: (not model.supported, model.name.lower(), str(model.path)))


def projector_beside(model: Path) -> Path | None:
    """The vision projector in `model`'s folder that pairs with it (as `find_models` pairs them), if any."""
    try:
        names = sorted(entry.name for entry in os.scandir(model.parent) if entry.is_file())
    except OSError:
        return None
    projectors = []
    for file_name in names:
        path = model.parent / file_name
        if not file_name.lower().endswith(".gguf") or path == model:
            continue
        header = read_scalar_metadata(path)
        if header is not None and _is_projector(file_name, header):
            projectors.append(path)
    return _pick_projector(model, projectors)


def _is_projector(file_name: str, header: dict[str, object]) -> bool:
    return (
        "mmproj" in file_name.lower()
        or header.get("general.type") == "mmproj"
        or header.get("general.architecture") in _PROJECTOR_ARCHITECTURES
    )


def _pick_projector(model: Path, projectors: Sequence[Path]) -> Path | None:
    """The projector beside `model`: the only one, else the one sharing the longest name prefix."""
    if not projectors:
        return None
    if len(projectors) == 1:
        return projectors[0]
    stem = model.name.lower()
    return max(projectors, key=lambda p: len(os.path.commonprefix([stem, p.name.lower().replace("mmproj-", "")])))


def _walk(root: Path) -> Iterable[tuple[Path, list[str]]]:
    if not root.is_dir():
        return
    base_depth = len(root.parts)
    # followlinks: the Hugging Face cache is symlinks from snapshots/ to blobs/; files are deduplicated by target.
    for folder, subfolders, files in os.walk(root, followlinks=True, onerror=lambda _err: None):
        path = Path(folder)
        if len(path.parts) - base_depth >= _MAX_DEPTH:
            subfolders.clear()
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "blobs"]
        yield path, sorted(files)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
