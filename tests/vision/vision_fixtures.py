"""Paths to and loaders of tests/fixtures/vision (made by make_vision.py with transformers and llama.cpp)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vision"
ORACLE = FIXTURES.parent / "oracle"
MMPROJ_F32 = FIXTURES / "tiny_vision.f32.gguf"
MMPROJ_F16 = FIXTURES / "tiny_vision.f16.gguf"
TEXT_F32 = FIXTURES / "tiny_vision_text.f32.gguf"
"""The text half of the checkpoint the mmproj files come from: tiny_tied with the vision tokens."""


@cache
def manifest() -> dict[str, Any]:
    return json.loads((FIXTURES / "manifest.json").read_text())


@cache
def arrays(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}
