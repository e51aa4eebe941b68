"""Benchmark files in llama.cpp's type mixes: named by shape and mix; an unknown mix is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmpchat.bench.model_files import bench_model_path
from cmpchat.errors import CmpchatError


def test_an_unknown_mix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CmpchatError, match="unknown type mix 'Q3_K_M'; choose one of Q8_0, Q4_K_M, Q5_K_M"):
        bench_model_path("9B", tmp_path, mix="Q3_K_M")


def test_a_file_built_before_is_reused_by_its_mix_name(tmp_path: Path) -> None:
    existing = tmp_path / "random-qwen35-27B-q4_k_m.gguf"
    existing.write_bytes(b"")  # stands in for a file built earlier (building a 27B takes minutes)
    assert bench_model_path("27B", tmp_path, mix="Q4_K_M") == existing
