"""GPU discovery and memory caps, without a GPU."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.device import GpuInfo, cuda_gpu_present, parse_size, stage_budgets
from cmpchat.errors import CmpchatError

GIB = 2**30


def test_no_gpu_under_the_simulator():
    assert not cuda_gpu_present()


@pytest.mark.parametrize(
    ("text", "expected"), [("16G", 16 * GIB), ("15.5GiB", int(15.5 * GIB)), ("800m", 800 * 2**20), ("1024", 1024)]
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_refuses_nonsense():
    with pytest.raises(CmpchatError, match="16G"):
        parse_size("lots")


def test_gpu_mem_caps_what_is_free():
    h200 = GpuInfo(0, "H200", (9, 0), free_bytes=139 * GIB, total_bytes=141 * GIB, multiprocessors=132)
    assert stage_budgets([h200], None) == [139 * GIB]
    assert stage_budgets([h200], 16 * GIB) == [16 * GIB]
    busy = GpuInfo(0, "CMP 100-210", (7, 0), free_bytes=10 * GIB, total_bytes=16 * GIB, multiprocessors=68)
    assert stage_budgets([busy], 16 * GIB) == [10 * GIB]


def test_stages_on_one_gpu_share_it_and_gpu_mem_caps_each_stage():
    h200 = GpuInfo(0, "H200", (9, 0), free_bytes=120 * GIB, total_bytes=141 * GIB, multiprocessors=132)
    cmp = GpuInfo(1, "CMP 100-210", (7, 0), free_bytes=15 * GIB, total_bytes=16 * GIB, multiprocessors=68)
    assert stage_budgets([h200, h200, h200], None) == [40 * GIB] * 3
    assert stage_budgets([h200, h200, h200], 16 * GIB) == [16 * GIB] * 3
    caps: list[int | None] = [50 * GIB, 8 * GIB, None]
    assert stage_budgets([h200, h200, cmp], caps) == [50 * GIB, 8 * GIB, 15 * GIB]
    with pytest.raises(CmpchatError, match="2 sizes for 3 stages"):
        stage_budgets([h200] * 3, [GIB, GIB])
    with pytest.raises(CmpchatError, match="positive"):
        stage_budgets([h200], 0)
