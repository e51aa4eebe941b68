"""The demo model: random weights with the real Qwen3.5 vocabulary and head sizes, built on first use.

It lets every front end (and later every GPU kernel) run on a fresh machine with no download. Its
replies are random text; everything that uses it says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cmpchat.chat.template import builtin_template
from cmpchat.model.builder import MODEL_SHAPES, build_model
from cmpchat.paths import cache_dir
from cmpchat.vocab import qwen35_vocabulary

DEMO_NOTICE = "demo model: random weights, so its replies are random text; use -m to load a real Qwen3.5 GGUF"
_DEMO_VERSION = 1  # bump when the builder or the template changes what the demo file holds
_DEMO_SEED = 35


def demo_model_path() -> Path:
    return cache_dir() / f"demo-qwen35-v{_DEMO_VERSION}.gguf"


def ensure_demo_model(progress: Callable[[str, int, int], None] | None = None) -> Path:
    """The demo model's path, building it first if needed; `progress(stage, done, total)` reports it."""
    path = demo_model_path()
    if path.exists():
        return path
    if progress is not None:
        progress("preparing the Qwen3.5 vocabulary", 0, 1)
    vocabulary = qwen35_vocabulary()
    build_model(
        path,
        MODEL_SHAPES["demo"],
        add_tokenizer=vocabulary.add_to_gguf,
        chat_template=builtin_template(),
        seed=_DEMO_SEED,
        description=DEMO_NOTICE,
        progress=None if progress is None else lambda done, total: progress("writing the demo model", done, total),
    )
    return path
