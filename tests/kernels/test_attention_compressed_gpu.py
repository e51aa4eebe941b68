"""Decode attention over a compressed cache on a GPU (`pytest -m gpu`) at Qwen3.5 9B's attention shape (16
query heads, 4 KV heads of 256, pages of 256 tokens) with the GPU's own tiling and split count, every GPU
format, a batch of a long, a short, an inactive and a one-token row, against the reference's cache in the
same format (test_attention_compressed.py's case and bound)."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.backends.gpu.memory_plan import PAGE_TOKENS
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.kv_codes import GPU_FORMATS
from tests.kernels.test_attention_compressed import CompressedCase, check_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
def test_the_9b_shape_with_the_gpus_tiling(format_name: str) -> None:
    lengths = [5000, 300, 0, 1]
    info = gpu_info(0)
    config = default_tuning(info).decode_attention_config(len(lengths), 16, 4, info.multiprocessors)
    check_case(CompressedCase(format_name, 16, 4, 256, lengths, page_tokens=PAGE_TOKENS, seed=4), config)
