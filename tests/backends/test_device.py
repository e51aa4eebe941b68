"""GPU discovery and memory caps, without a GPU."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.device import GpuInfo, cuda_gpu_present, parse_size, usable_bytes
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
    assert usable_bytes(h200, None) == 139 * GIB
    assert usable_bytes(h200, 16 * GIB) == 16 * GIB
    busy = GpuInfo(0, "CMP 100-210", (7, 0), free_bytes=10 * GIB, total_bytes=16 * GIB, multiprocessors=68)
    assert usable_bytes(busy, 16 * GIB) == 10 * GIB
