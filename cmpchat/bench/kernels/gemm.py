"""GPU micro-benchmark of the prefill GEMM at Qwen3.5 projection shapes, reported against the DP4A peak.

`python -m cmpchat.bench.kernels.gemm [9B 27B] [--tokens 512 2048]` prints, per shape and token
count, the time per launch and the rate it does 2 * rows * cols * T ops at (8 ops per dp4a, the counting of
`throughput_probes`), next to the DP4A rate measured in the same run (`throughput_probes.compute_rate`,
as `cmpchat doctor`), so the ratio carries over from the H200 to the CMP; `--types Q4_K Q6_K` times the
4/5/6-bit GEMM of those types (random bits in their layout) beside or instead of Q8_0. `--sweep` times every tiling in
`gemm.SWEEP_TILINGS` on every shape instead, to choose the device table's tiling by measurement (`device_table.py`;
CMPCHAT_TUNING=sm_70 makes another row's the default timed).

Shapes are the decode GEMV's (`gemv_bench.QWEN_GEMV_SHAPES`, fused layouts) less the LM head: a prefill
needs logits for its last token only, which the GEMV computes. Timing as `gemv_bench`: the launches are
captured as a CUDA graph and CUDA events time back-to-back replays (`time_launches`); the weight is cycled
through copies worth `cycle_bytes`, so a launch finds its weight in DRAM as a prefill layer does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.bench.kernels import add_shapes_argument
from cmpchat.bench.kernels.device import bench_gpu
from cmpchat.bench.kernels.gemv import QWEN_GEMV_SHAPES, random_kquant_copies
from cmpchat.cudart.profile import time_launches
from cmpchat.kernels.gemm import SWEEP_TILINGS, GemmTiling, gemm_kquant_launch, gemm_q8_launch
from cmpchat.kernels.gemv import output_shape, weight_bytes
from cmpchat.kernels.gemv_kquant import FORMATS
from cmpchat.kernels.quantize import QUANT_BLOCK
from cmpchat.kernels.throughput_probes import DP4A_PROBE, compute_rate

PREFILL_SHAPES: dict[str, list[tuple[str, int, int, str]]] = {
    model: [shape for shape in shapes if shape[0] != "lm head"] for model, shapes in QWEN_GEMV_SHAPES.items()
}
"""(name, rows, cols, mode) of every Q8_0 projection a prefill runs over all its tokens."""


@dataclass(frozen=True)
class GemmTiming:
    name: str
    rows: int
    cols: int
    tokens: int
    mode: str
    seconds: float
    """Per launch."""

    @property
    def ops(self) -> int:
        """2 * rows * cols * T: a multiply and an add per weight per token (8 per dp4a). SwiGLU counts the
        gate and up rows both, as the kernel computes them."""
        return 2 * self.rows * self.cols * self.tokens

    @property
    def tops(self) -> float:
        return self.ops / self.seconds / 1e12


def benchmark_gemm(
    rows: int, cols: int, tokens: int, *, mode: str = "store", name: str = "", repeats: int = 20, warmup: int = 3,
    seed: int = 0, cycle_bytes: int = 256 << 20, tiling: GemmTiling | None = None, type_name: str = "Q8_0",
) -> GemmTiming:  # fmt: skip
    """Time the GEMM for this shape, token count and weight type (needs a GPU) in `tiling` (default: the GPU's
    row's)."""
    problem = _DeviceProblem(rows, cols, tokens, mode, seed, cycle_bytes, type_name)
    return GemmTiming(name, rows, cols, tokens, mode, problem.time(tiling, repeats, warmup))


class _DeviceProblem:
    """Random operands on the GPU, the weight repeated in copies totalling `cycle_bytes` (launches cycle
    through them, so the H200's 50 MB L2 does not hold the weight from one launch to the next)."""

    def __init__(
        self, rows: int, cols: int, tokens: int, mode: str, seed: int, cycle_bytes: int, type_name: str = "Q8_0"
    ) -> None:
        rng = np.random.default_rng(seed)
        self.tensor_type = GGMLQuantizationType[type_name]
        if self.tensor_type == GGMLQuantizationType.Q8_0:
            quants = rng.integers(-127, 128, (rows, cols), dtype=np.int8).view(np.uint32)
            scales = (rng.random((rows, cols // QUANT_BLOCK)) * 0.01).astype(np.float16)
            copies = max(1, -(-cycle_bytes // weight_bytes(rows, cols)))
            self.weights: list[Any] = [(cuda.to_device(quants), cuda.to_device(scales)) for _ in range(copies)]
        else:
            fmt = FORMATS[self.tensor_type]
            copies = max(1, -(-cycle_bytes // fmt.matrix_bytes(rows, cols)))
            self.weights = random_kquant_copies(fmt, rows, cols, rng, copies)
        self.x_quants = cuda.to_device(rng.integers(-127, 128, (tokens, cols), dtype=np.int8).view(np.uint32))
        self.x_scales = cuda.to_device(rng.random((tokens, cols // QUANT_BLOCK)).astype(np.float32))
        self.out = cuda.to_device(np.zeros(output_shape(rows, tokens, mode), np.float32))
        self.cols, self.mode = cols, mode

    def time(self, tiling: GemmTiling | None, repeats: int, warmup: int) -> float:
        """Seconds per launch (tiling None: the GPU's row's)."""
        gpu, tuning = bench_gpu()
        tiling = tiling or tuning.gemm
        x = (self.x_quants, self.x_scales, self.out)
        if self.tensor_type == GGMLQuantizationType.Q8_0:
            launches = [
                gemm_q8_launch(quants, scales, *x, mode=self.mode, tiling=tiling) for quants, scales in self.weights
            ]
        else:
            launches = [gemm_kquant_launch(self.tensor_type, w, self.cols, *x, mode=self.mode, tiling=tiling)
                        for w in self.weights]  # fmt: skip
        return time_launches(launches, repeats, warmup, early_launch=tuning.launches_early(gpu)) / len(launches)


def sweep_tilings(model: str, tokens: list[int], repeats: int, peak: float) -> None:
    """Time every tiling of `SWEEP_TILINGS` on every prefill projection of `model`, and the total per token
    count (each projection once), so the default can be chosen by measurement."""
    print(f"{model}: GEMM tilings (rows x tokens, k stage blocks, p prefetch, w warps per SM) -> µs per launch "
          "(% of the dp4a peak)")  # fmt: skip
    for count in tokens:
        totals = dict.fromkeys(SWEEP_TILINGS, 0.0)
        for name, rows, cols, mode in PREFILL_SHAPES[model]:
            problem = _DeviceProblem(rows, cols, count, mode, 0, 256 << 20)
            ops = 2 * rows * cols * count
            times = {tiling: problem.time(tiling, repeats, 3) for tiling in SWEEP_TILINGS}
            for tiling, seconds in times.items():
                totals[tiling] += seconds
            cells = " ".join(f"{t.label}:{s * 1e6:.0f} ({ops / s / peak:.0%})" for t, s in times.items())
            print(f"  T={count:<5} {name:24} {cells}")
        best, default = min(totals, key=totals.__getitem__), bench_gpu()[1].gemm
        print(f"  T={count:<5} all projections: best {best.label} {totals[best] * 1e3:.3f} ms; default "
              f"{default.label} {totals[default] * 1e3:.3f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shapes_argument(parser, PREFILL_SHAPES, PREFILL_SHAPES)
    parser.add_argument("--tokens", nargs="*", type=int, default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time every tiling in SWEEP_TILINGS instead")
    parser.add_argument("--types", nargs="+", choices=["Q8_0", *(t.name for t in FORMATS)], default=["Q8_0"],
                        help="weight types to time (default Q8_0)")  # fmt: skip
    args = parser.parse_args(argv)

    peak = compute_rate(DP4A_PROBE)
    print(f"dp4a peak: {peak / 1e12:.1f} TOPS (8 ops per dp4a)")
    if args.sweep:
        for model in args.models:
            sweep_tilings(model, args.tokens, args.repeats, peak)
        return
    print(f"{'model':5} {'type':5} {'shape':24} {'rows':>7} {'cols':>6} {'T':>5} {'mode':10} {'µs':>10} {'TOPS':>7} "
          f"{'of dp4a':>8}")  # fmt: skip
    for model in args.models:
        for type_name in args.types:
            seconds, ops = dict.fromkeys(args.tokens, 0.0), dict.fromkeys(args.tokens, 0)
            for name, rows, cols, mode in PREFILL_SHAPES[model]:
                for tokens in args.tokens:
                    t = benchmark_gemm(rows, cols, tokens, mode=mode, name=name, repeats=args.repeats,
                                       type_name=type_name)  # fmt: skip
                    seconds[tokens] += t.seconds
                    ops[tokens] += t.ops
                    print(
                        f"{model:5} {type_name:5} {name:24} {rows:7} {cols:6} {tokens:5} {mode:10} "
                        f"{t.seconds * 1e6:10.1f} {t.tops:7.2f} {t.tops * 1e12 / peak:8.1%}"
                    )
            for tokens in args.tokens:
                tops = ops[tokens] / seconds[tokens] / 1e12
                print(f"{model:5} {type_name:5} {'all projections':24} {'':7} {'':6} {tokens:5} {'':10} "
                      f"{seconds[tokens] * 1e6:10.1f} {tops:7.2f} {tops * 1e12 / peak:8.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
