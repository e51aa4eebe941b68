"""Where cmpchat keeps its files (per-user cache, data and config folders)."""

from __future__ import annotations

from pathlib import Path

import platformdirs

APP_NAME = "cmpchat"


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP_NAME))


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME))
