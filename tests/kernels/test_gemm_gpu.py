"""The prefill GEMM on a GPU (`pytest -m gpu`) at every prefill projection of Qwen3.5 9B and 27B (9B hidden
4096, ffn 12288; 27B hidden 5120, ffn 17408; the fused layouts the backend uses) for 64, 512 and 2048
tokens, against float64 numpy; token counts that leave tails; every sweep tiling; and the benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.bench.kernels.gemm import PREFILL_SHAPES, benchmark_gemm
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.gemm import SWEEP_TILINGS, GemmTiling, gemm_q8_launch
from cmpchat.kernels.throughput_probes import DP4A_PROBE, compute_rate
from tests.kernels.q8_reference import device, q8_problem
from tests.kernels.test_gemv_sim import assert_close

pytestmark = pytest.mark.gpu

MAX_TOKENS = 2048
SHAPES = [(model, *shape) for model, shapes in PREFILL_SHAPES.items() for shape in shapes]
ROW_CHUNK = 4096  # float64 reference in slices of rows


def problem(rows: int, cols: int) -> tuple[np.ndarray, ...]:
    return q8_problem(rows, cols, MAX_TOKENS, ROW_CHUNK)


def check_gemm(rows: int, cols: int, mode: str, tokens: int, tiling: GemmTiling | None = None) -> None:
    quants, scales, x_quants, x_scales, expected, magnitude = problem(rows, cols)
    expected, magnitude = expected[:tokens], magnitude[:tokens]
    args = (
        device(quants.view(np.uint32)),
        device(scales),
        device(x_quants[:tokens].view(np.uint32)),
        device(x_scales[:tokens]),
    )
    if tiling is None:  # what the GPU's row of the device table runs
        tiling = default_tuning(gpu_info(0)).gemm
    if mode == "swiglu":
        half = rows // 2
        out = device(np.zeros((tokens, half), np.float32))
        gemm_q8_launch(*args, out, mode=mode, tiling=tiling).run()
        gate, up = expected[:, :half], expected[:, half:]
        reference = gate / (1 + np.exp(-gate)) * up
        bound = 1e-5 * (magnitude[:, :half] * np.abs(up) + np.abs(gate) * magnitude[:, half:]) + 1e-6 * np.abs(
            reference
        )
        assert (np.abs(out.copy_to_host() - reference) <= bound + 1e-30).all()
    elif mode == "accumulate":
        residual = np.random.default_rng(1).standard_normal((tokens, rows)).astype(np.float32)
        out = device(residual)
        gemm_q8_launch(*args, out, mode=mode, tiling=tiling).run()
        assert_close(out.copy_to_host(), expected + residual, magnitude + np.abs(residual))
    else:
        out = device(np.zeros((tokens, rows), np.float32))
        gemm_q8_launch(*args, out, mode=mode, tiling=tiling).run()
        assert_close(out.copy_to_host(), expected, magnitude)


@pytest.mark.parametrize("tokens", [64, 512, pytest.param(2048, marks=pytest.mark.slow)])  # float64 refs: seconds
@pytest.mark.parametrize("model,name,rows,cols,mode", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_q8_gemm_at_qwen_shapes(model: str, name: str, rows: int, cols: int, mode: str, tokens: int) -> None:
    check_gemm(rows, cols, mode, tokens)


@pytest.mark.parametrize("tokens", [17, 100, 1000])
@pytest.mark.parametrize("mode", ["store", "swiglu"])
def test_token_counts_that_leave_tails(mode: str, tokens: int) -> None:
    """The GEMM's smallest token count (17, the GEMV takes 16) and counts no tile divides, on the 9B
    gdn qkv+gate+beta+alpha rows (12352: no row tile divides them either) and the 9B ffn gate+up."""
    rows = 8192 + 4096 + 32 + 32 if mode == "store" else 2 * 12288
    check_gemm(rows, 4096, mode, tokens)


@pytest.mark.parametrize("tiling", SWEEP_TILINGS, ids=lambda tiling: tiling.label)
@pytest.mark.parametrize("mode", ["accumulate", "swiglu"])
def test_every_sweep_tiling(tiling: GemmTiling, mode: str) -> None:
    """What `gemm_bench --sweep` times is correct too (27B ffn down, or 9B ffn gate+up, 300 tokens)."""
    rows, cols = (5120, 17408) if mode == "accumulate" else (2 * 12288, 4096)
    check_gemm(rows, cols, mode, 300, tiling)


def test_benchmark_reports_tops() -> None:
    """Smoke test of the benchmark (run with -s to see the figures against the dp4a peak of this GPU)."""
    peak = compute_rate(DP4A_PROBE)
    assert peak > 0
    for model in PREFILL_SHAPES:
        for name, rows, cols, mode in PREFILL_SHAPES[model]:
            timing = benchmark_gemm(rows, cols, 512, mode=mode, name=name, repeats=5, warmup=2)
            print(f"{model} {name:24} T=512 {timing.seconds * 1e6:9.1f} µs {timing.tops:6.2f} TOPS "
                  f"{timing.tops * 1e12 / peak:6.1%} of {peak / 1e12:.1f}")  # fmt: skip
            assert timing.tops > 0
