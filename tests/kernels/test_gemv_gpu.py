"""The GEMV kernels on a GPU (`pytest -m gpu`) at every decode projection of Qwen3.5 9B and 27B, with the
fused layouts the backend uses, against float64 numpy; plus the float fallback and the benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.bench.kernels.gemv import QWEN_GEMV_SHAPES, benchmark_gemv
from cmpchat.kernels.gemv import gemv_q8_launch
from cmpchat.kernels.gemv_float import gemv_float_launch
from cmpchat.kernels.throughput_probes import streaming_read_bandwidth
from tests.kernels.q8_reference import device, q8_problem
from tests.kernels.test_gemv_sim import assert_close, bf16_bits

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
SHAPES = [(model, *shape) for model, shapes in QWEN_GEMV_SHAPES.items() for shape in shapes]
ROW_CHUNK = 8192  # float64 reference in slices of rows


def problem(rows: int, cols: int) -> tuple[np.ndarray, ...]:
    return q8_problem(rows, cols, MAX_TOKENS, ROW_CHUNK)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("model,name,rows,cols,mode", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_q8_gemv_at_qwen_shapes(model: str, name: str, rows: int, cols: int, mode: str, tokens: int) -> None:
    quants, scales, x_quants, x_scales, expected, magnitude = problem(rows, cols)
    expected, magnitude = expected[:tokens], magnitude[:tokens]
    args = (
        device(quants.view(np.uint32)),
        device(scales),
        device(x_quants[:tokens].view(np.uint32)),
        device(x_scales[:tokens]),
    )
    if mode == "swiglu":
        half = rows // 2
        out = device(np.zeros((tokens, half), np.float32))
        gemv_q8_launch(*args, out, mode=mode).run()
        gate, up = expected[:, :half], expected[:, half:]
        reference = gate / (1 + np.exp(-gate)) * up
        bound = 1e-5 * (magnitude[:, :half] * np.abs(up) + np.abs(gate) * magnitude[:, half:]) + 1e-6 * np.abs(
            reference
        )
        assert (np.abs(out.copy_to_host() - reference) <= bound + 1e-30).all()
    elif mode == "accumulate":
        residual = np.random.default_rng(1).standard_normal((tokens, rows)).astype(np.float32)
        out = device(residual)
        gemv_q8_launch(*args, out, mode=mode).run()
        assert_close(out.copy_to_host(), expected + residual, magnitude + np.abs(residual))
    else:
        out = device(np.zeros((tokens, rows), np.float32))
        gemv_q8_launch(*args, out, mode=mode).run()
        assert_close(out.copy_to_host(), expected, magnitude)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_float_weights_at_a_real_shape(kind: str, tokens: int) -> None:
    rng = np.random.default_rng(9)
    rows, cols = 4096, 4096
    values = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    weights: dict[str, np.ndarray] = {"f32": values, "f16": values.astype(np.float16), "bf16": bf16_bits(values)}
    weight = weights[kind]
    exact = (weight.astype(np.uint32) << 16).view(np.float32) if kind == "bf16" else weight.astype(np.float32)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    out = device(np.zeros((tokens, rows), np.float32))
    gemv_float_launch(device(weight), device(x), out, bf16=kind == "bf16").run()
    expected = x.astype(np.float64) @ exact.T.astype(np.float64)
    assert_close(out.copy_to_host(), expected, np.abs(x.astype(np.float64)) @ np.abs(exact.T.astype(np.float64)))


def test_benchmark_reports_bandwidth() -> None:
    """Smoke test of the benchmark (run with -s to see the figures; tuning targets >= 85% of the read limit)."""
    limit = streaming_read_bandwidth(1 << 28, repeats=5) / 1e9
    assert limit > 0
    for model in QWEN_GEMV_SHAPES:
        for name, rows, cols, mode in QWEN_GEMV_SHAPES[model]:
            timing = benchmark_gemv(rows, cols, 1, mode=mode, name=name, repeats=20, warmup=3)
            print(f"{model} {name:24} {timing.seconds * 1e6:8.1f} µs {timing.gigabytes_per_second:7.0f} GB/s "
                  f"{timing.gigabytes_per_second / limit:6.1%} of {limit:.0f} GB/s")  # fmt: skip
            assert timing.gigabytes_per_second > 0


def test_fixed_costs_names_every_projection(capsys: pytest.CaptureFixture[str]) -> None:
    """`gemv_bench --fixed-costs` runs and reports each 9B projection with positive times."""
    from cmpchat.bench.kernels.gemv import main

    main(["9B", "--fixed-costs", "--repeats", "3"])
    printed = capsys.readouterr().out
    for name, *_ in QWEN_GEMV_SHAPES["9B"]:
        line = next(line for line in printed.splitlines() if line.strip().startswith(name))
        figures = [float(word) for word in line.split() if word.replace(".", "", 1).replace("-", "", 1).isdigit()]
        assert figures[0] > 0 and figures[3] > 0 and figures[4] > 0  # fused, one pair, unfused
