"""The fused one-token GEMV on a GPU (`pytest -m gpu`) at every decode projection of Qwen3.5 9B and 27B:
bit for bit what the unfused launches (RMSNorm+quantise or quantise, then the T=1 GEMV) compute."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.bench.kernels.gemv import QWEN_GEMV_SHAPES, SWEEP_SHAPES
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.gemv import gemv_q8_launch
from cmpchat.kernels.gemv_fused import STEP_CHOICES, FusedGemvTiling, gemv_q8_fused_launch
from cmpchat.kernels.quantize import quantize_launch, rms_norm_quantize_launch

pytestmark = pytest.mark.gpu

SHAPES = [(model, *shape) for model, shapes in QWEN_GEMV_SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("model,name,rows,cols,mode", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_fused_equals_the_unfused_launches(
    model: str, name: str, rows: int, cols: int, mode: str, normed: bool
) -> None:
    gpu = gpu_info(0)
    tiling = default_tuning(gpu).gemv_tiling(rows, cols, mode, gpu.multiprocessors)  # what a decode step runs
    check_fused_equals_unfused(rows, cols, mode, normed, tiling)


@pytest.mark.parametrize("steps", STEP_CHOICES)
@pytest.mark.parametrize("groups, blocks_per_sm", SWEEP_SHAPES)
def test_every_tiling_gives_the_same_bits(steps: int, groups: int, blocks_per_sm: int) -> None:
    tiling = FusedGemvTiling(steps, blocks_per_sm, groups)
    check_fused_equals_unfused(5120, 17408, "accumulate", False, tiling)
    check_fused_equals_unfused(2 * 17408, 5120, "swiglu", True, tiling)
    check_fused_equals_unfused(14336, 5120, "store", True, tiling)


def check_fused_equals_unfused(rows: int, cols: int, mode: str, normed: bool, tiling: FusedGemvTiling) -> None:
    rng = np.random.default_rng(rows + cols)
    quants = cuda.to_device(rng.integers(-127, 128, (rows, cols), dtype=np.int8).view(np.uint32))
    scales = cuda.to_device((rng.standard_normal((rows, cols // 32)) * 0.01).astype(np.float16))
    x = cuda.to_device((3 * rng.standard_normal((1, cols))).astype(np.float32))
    weight = cuda.to_device((1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
    out_rows = rows // 2 if mode == "swiglu" else rows
    start = rng.standard_normal((1, out_rows)).astype(np.float32)  # the residual, for accumulate
    x_quants = cuda.device_array((1, cols // 4), np.uint32)
    x_scales = cuda.device_array((1, cols // 32), np.float32)
    if normed:
        rms_norm_quantize_launch(x, weight, 1e-6, x_quants, x_scales).run()
    else:
        quantize_launch(x, x_quants, x_scales).run()
    unfused = cuda.to_device(start)
    gemv_q8_launch(quants, scales, x_quants, x_scales, unfused, mode=mode).run()
    fused = cuda.to_device(start)
    sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT
    norm = weight if normed else None
    gemv_q8_fused_launch(
        quants, scales, x, fused, mode=mode, norm_weight=norm, eps=1e-6, sm_count=sm_count, tiling=tiling
    ).run()
    np.testing.assert_array_equal(fused.copy_to_host(), unfused.copy_to_host())
