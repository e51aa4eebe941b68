"""Benchmark model files: random weights with the exact tensor shapes of a released size, Q8_0 or one of
llama.cpp's type mixes (Q4_K_M, Q5_K_M: `model.builder.matrix_types`).

Made by the same builder as the demo model, with the real Qwen3.5 tokenizer, so llama.cpp loads the same
file. Built once per folder and reused; weights come from a pool of random blocks (written at disk speed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cmpchat.errors import CmpchatError
from cmpchat.model.builder import MIXES, MODEL_SHAPES, build_model

BENCH_SHAPES = ("0.8B", "2B", "4B", "9B", "27B")


def bench_model_path(
    name: str, folder: Path, progress: Callable[[str, int, int], None] | None = None, *, mix: str = "Q8_0"
) -> Path:
    """The benchmark file for a shape name in the type mix `mix` (a name in `MIXES`; built on first use), or
    `name` itself when it is a GGUF path."""
    if name not in BENCH_SHAPES:
        path = Path(name)
        if not path.is_file():
            raise CmpchatError(f"'{name}' is neither a model shape ({', '.join(BENCH_SHAPES)}) nor a GGUF file")
        return path
    if mix not in MIXES:
        raise CmpchatError(f"unknown type mix '{mix}'; choose one of {', '.join(MIXES)}")
    path = folder / f"random-qwen35-{name}-{mix.lower()}.gguf"
    if not path.exists():
        from cmpchat.vocab import qwen35_vocabulary

        stage = f"building {path.name} (random weights, {name} shapes)"

        def report(done: int, total: int) -> None:
            if progress is not None:
                progress(stage, done, total)

        try:
            build_model(
                path,
                MODEL_SHAPES[name],
                add_tokenizer=qwen35_vocabulary().add_to_gguf,
                chat_template=None,
                description=f"cmpchat benchmark file: random {mix} weights with the tensor shapes of Qwen3.5 {name}",
                progress=report,
                pooled=True,
                mix=mix,
            )
        except OSError as error:  # a full disk, a read-only folder: the partial file is not left as the model
            raise CmpchatError(f"cannot write {path}: {error.strerror or error}; free space or pass --folder") from None
    return path
