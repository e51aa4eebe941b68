"""The device table (`cmpchat/kernels/device_table.py`): which row each GPU gets, what the rows hold, and how a
test or benchmark runs another row."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.device import SIMULATED_GPU, GpuInfo
from cmpchat.errors import CmpchatError
from cmpchat.kernels.attention import DecodeAttentionConfig
from cmpchat.kernels.attention_prefill import SIMULATOR_CONFIG, PrefillAttentionConfig
from cmpchat.kernels.device_table import (
    SIMULATOR_TUNING,
    SM_70,
    SM_80,
    SM_90,
    TABLE,
    TUNING_VARIABLE,
    DeviceSpec,
    default_tuning,
    tuning_for,
    tuning_named,
)
from cmpchat.kernels.gemm import GPU_TILING, SIMULATOR_TILING, SM70_TILING


def test_the_cmp_gets_the_sm_70_row_and_the_h200_the_sm_90_row() -> None:
    assert tuning_for(DeviceSpec((7, 0), 80)) is SM_70  # the CMP 100-210
    assert tuning_for(DeviceSpec((7, 0), 68)) is SM_70  # a row serves every SM count
    assert tuning_for(DeviceSpec((9, 0), 132)) is SM_90  # the H200
    h200 = GpuInfo(0, "NVIDIA H200", (9, 0), free_bytes=139 << 30, total_bytes=141 << 30, multiprocessors=132)
    assert tuning_for(h200) is SM_90  # what the backend reads at load is a device


def test_an_unknown_gpu_gets_the_row_of_the_nearest_older_capability() -> None:
    assert tuning_for(DeviceSpec((7, 5), 40)) is SM_70  # Turing
    assert tuning_for(DeviceSpec((8, 6), 84)) is SM_80  # Ampere
    assert tuning_for(DeviceSpec((8, 9), 128)) is SM_80  # Ada
    assert tuning_for(DeviceSpec((10, 0), 148)) is SM_90  # Blackwell
    assert tuning_for(DeviceSpec((12, 0), 170)) is SM_90
    assert tuning_for(DeviceSpec((6, 1), 20)) is SM_70  # older than every row: the oldest
    assert [row.capability for row in TABLE] == sorted(row.capability for row in TABLE)


def test_the_rows_hold_what_each_gpu_ran_before_the_table() -> None:
    """sm_70 holds the GEMM's prefetch in 168 registers and has no early launch; from sm_80 the 16-warp GEMM;
    early launch from sm_90; the rest is the same in every row (measured on the H200)."""
    assert (SM_70.gemm, SM_80.gemm, SM_90.gemm) == (SM70_TILING, GPU_TILING, GPU_TILING)
    assert SM_70.gemm.blocks_per_sm * SM_70.gemm.threads // 32 == 12  # the launch bounds: 12 warps per SM
    assert (SM_70.early_launch, SM_80.early_launch, SM_90.early_launch) == (False, False, True)
    for row in (*TABLE, SIMULATOR_TUNING):
        assert (row.gemv_narrow.groups, row.gemv_narrow.blocks_per_sm, row.gemv_narrow.steps) == (2, 1, 4)
        assert (row.gemv_wide.groups, row.gemv_wide.blocks_per_sm, row.gemv_wide.steps) == (3, 1, 4)
        assert row.gemv_wide_columns == 4096
        assert row.decode_attention == DecodeAttentionConfig(num_splits=1)
        assert [row.split_blocks(group) for group in (1, 2, 4, 6, 8)] == [4, 4, 4, 2, 4]
    for row in TABLE:
        assert row.prefill_attention == PrefillAttentionConfig(num_splits=1)
        assert row.page_tile(256) == 64  # decode's 16-token tiles, prefill's 64-key tiles
    assert SIMULATOR_TUNING.gemm == SIMULATOR_TILING
    assert SIMULATOR_TUNING.prefill_attention == PrefillAttentionConfig(num_splits=1, **SIMULATOR_CONFIG)
    assert not SIMULATOR_TUNING.early_launch


def test_early_launch_needs_the_row_and_the_hardware() -> None:
    assert SM_90.launches_early(DeviceSpec((9, 0), 132))
    assert not SM_70.launches_early(DeviceSpec((9, 0), 132))  # the CMP's row on the H200 launches as the CMP
    assert not SM_90.launches_early(DeviceSpec((7, 0), 80))  # the H200's row on a GPU without it


def test_the_simulator_runs_its_own_row_and_the_environment_names_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TUNING_VARIABLE, raising=False)
    assert default_tuning(SIMULATED_GPU) is SIMULATOR_TUNING  # these tests run under the simulator
    monkeypatch.setenv(TUNING_VARIABLE, "sm_70")
    assert default_tuning(DeviceSpec((9, 0), 132)) is SM_70
    assert tuning_named("sm_90") is SM_90 and tuning_named("simulator") is SIMULATOR_TUNING
    monkeypatch.setenv(TUNING_VARIABLE, "sm_75")
    with pytest.raises(CmpchatError, match="no tuning row is called 'sm_75'; the rows are sm_70, sm_80, sm_90"):
        default_tuning(SIMULATED_GPU)


def test_the_rows_rules_take_the_devices_sm_count() -> None:
    """The split counts and the GEMV's grid follow the SM count the caller gives, whatever the row."""
    assert SM_70.decode_attention_config(1, 16, 4, 80).num_splits == 80  # 4 blocks per SM at G=4
    assert SM_70.decode_attention_config(1, 24, 4, 80).num_splits == 40  # 2 at G=6
    assert SM_90.decode_attention_config(16, 16, 4, 132).num_splits == 9
    prefill = SM_70.prefill_attention_config(256, 16, 4, 80)  # 16 query tiles x 4 KV heads
    assert prefill.num_splits == 5 and prefill.warps == 8 and prefill.tile_keys == 64
    warps = 132 * SM_90.gemv_narrow.block_threads // 32  # the narrow grid's warps on 132 SMs (2112 on a GPU)
    assert SM_90.gemv_tiling(2 * warps, 12288, "accumulate", 132) == SM_90.gemv_narrow  # a warp for each pair
    assert SM_70.gemv_tiling(2 * warps, 12288, "accumulate", 80) == SM_70.gemv_wide  # 80 SMs have fewer
