"""Prefill attention over a compressed cache on a GPU (`pytest -m gpu`) at Qwen3.5 9B's attention shape (16
query heads, 4 KV heads of 256, pages of 256 tokens) with the GPU's own tiling and split count: every GPU format,
256 rows at cache offsets 0 and 3000 with an inactive row, against the reference's cache in the same format
(test_attention_prefill_compressed.py's case and bound)."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.backends.gpu.memory_plan import PAGE_TOKENS
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.kv_codes import GPU_FORMATS
from tests.kernels.test_attention_prefill_compressed import CompressedPrefillCase, check_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("offset", [0, 3000])
@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
def test_the_9b_shape_with_the_gpus_tiling(format_name: str, offset: int) -> None:
    info = gpu_info(0)
    config = default_tuning(info).prefill_attention_config(256, 16, 4, info.multiprocessors)
    case = CompressedPrefillCase(format_name, 16, 4, 256, rows=256, offset=offset, page_tokens=PAGE_TOKENS,
                                 inactive=(77,), seed=offset)  # fmt: skip
    check_case(case, config)
