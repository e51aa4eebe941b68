"""Themes are data: TOML files of Textual theme colours, one theme per file.

Looked for, in order (a later file with the same theme name wins):
1. the project's top-level `themes/` folder, reached through the `cmpchat/tui/theme_files` link, which
   also makes a wheel carry the files (package data `tui/theme_files/*.toml`) into installed copies,
2. `themes/` in the user's config folder, for the person's own themes.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

from textual.theme import Theme

import cmpchat
from cmpchat.paths import config_dir

DEFAULT_THEME = "cmpchat-dark"

_THEME_KEYS = {f.name for f in fields(Theme)}


def theme_folders() -> list[Path]:
    """The folders themes are read from, the ones that exist, lowest precedence first."""
    package = Path(cmpchat.__file__).resolve().parent
    # The link inside the package, then the folder itself, for checkouts where the link was not kept.
    candidates = [package / "tui" / "theme_files", package.parent / "themes", config_dir() / "themes"]
    seen: list[Path] = []
    for folder in candidates:
        if folder.is_dir() and folder.resolve() not in [s.resolve() for s in seen]:
            seen.append(folder)
    return seen


def load_theme(path: Path) -> Theme:
    """The theme in one TOML file; `ValueError` says what is wrong with it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"{path.name}: {err}") from None
    unknown = sorted(set(data) - _THEME_KEYS)
    if unknown:
        raise ValueError(f"{path.name}: unknown keys {', '.join(unknown)}")
    data.setdefault("name", path.stem)
    if "primary" not in data:
        raise ValueError(f"{path.name}: a theme needs at least a 'primary' colour")
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ValueError(f"{path.name}: [variables] must map names to colour strings")
    theme = Theme(**data)
    try:
        theme.to_color_system().generate()
    except Exception as err:  # a colour Textual cannot parse: report it rather than fail at switch time
        raise ValueError(f"{path.name}: {err}") from None
    return theme


def load_themes(folders: list[Path] | None = None) -> tuple[list[Theme], list[str]]:
    """All themes in `folders` (default `theme_folders()`), and a line for each file that failed."""
    themes: dict[str, Theme] = {}
    problems: list[str] = []
    for folder in theme_folders() if folders is None else folders:
        for path in sorted(folder.glob("*.toml")):
            try:
                theme = load_theme(path)
            except ValueError as err:
                problems.append(f"theme {err}")
                continue
            themes[theme.name] = theme
    return list(themes.values()), problems
