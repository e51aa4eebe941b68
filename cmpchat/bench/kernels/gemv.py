"""GPU micro-benchmark of the Q8_0 GEMV at Qwen3.5 decode shapes, reported against the read limit.

`python -m cmpchat.bench.kernels.gemv [9B 27B] [--tokens 1 4 16]` prints, per shape, the time per
launch and the bytes it must read divided by that time, next to the streaming-read bandwidth measured in
the same run (`throughput_probes.streaming_read_bandwidth`, as `cmpchat doctor`), so the ratio carries
over from the H200 to the CMP. `--sweep` times every one-token tiling (`FusedGemvTiling`) on every shape
and names the fastest for a whole decode step: how the device table's choice is made (`device_table.py`;
CMPCHAT_TUNING=sm_70 times another row's). `--fixed-costs` shows what a
one-token launch pays beside streaming its weight: an empty launch, the launch's excess over its weight's
streaming time at the read bandwidth, the same kernel on a single row pair (launch, prologue and one pair's
loop, nothing to overlap them), and the unfused kernel on an already-quantised input (no prologue).
`--types Q4_K Q6_K` times the 4/5/6-bit GEMV (`gemv_kquant.py`, on int8 activations at every token count) at
the same shapes instead, against the bytes of its repacked layout.

Timing: the launches are captured as a CUDA graph and CUDA events time back-to-back replays, so neither
Numba's launch path (tens of µs per launch, longer than a small GEMV runs) nor L2 hits (each weight is
cycled through copies worth 1 GiB) are what is measured.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.bench.kernels import add_shapes_argument
from cmpchat.bench.kernels.device import bench_gpu
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.profile import time_launches
from cmpchat.cudart.selftest_kernels import count_launch
from cmpchat.kernels.gemv import gemv_q8_launch, output_shape, weight_bytes
from cmpchat.kernels.gemv_fused import STEP_CHOICES, FusedGemvTiling, gemv_kquant_fused_launch, gemv_q8_fused_launch
from cmpchat.kernels.gemv_kquant import ARRAY_DTYPES, FORMATS, KQuantArrays, KQuantFormat, kquant_matmul_launch
from cmpchat.kernels.quantize import QUANT_BLOCK
from cmpchat.model.builder import MODEL_SHAPES

# (name, rows, cols, mode) of every Q8_0 projection a decode step runs, with the fused layouts the
# backend uses (docs/model.md, "On the GPU"): q|k|v, GDN qkv|gate|beta|alpha, ffn gate|up (SwiGLU); residual adds accumulate.
QWEN_GEMV_SHAPES: dict[str, list[tuple[str, int, int, str]]] = {
    "9B": [
        ("attn q+k+v", 8192 + 2 * 1024, 4096, "store"),
        ("attn output", 4096, 4096, "accumulate"),
        ("gdn qkv+gate+beta+alpha", 8192 + 4096 + 32 + 32, 4096, "store"),
        ("gdn ssm_out", 4096, 4096, "accumulate"),
        ("ffn gate+up", 2 * 12288, 4096, "swiglu"),
        ("ffn down", 4096, 12288, "accumulate"),
        ("lm head", 248320, 4096, "store"),
    ],
    "27B": [
        ("attn q+k+v", 12288 + 2 * 1024, 5120, "store"),
        ("attn output", 5120, 6144, "accumulate"),
        ("gdn qkv+gate+beta+alpha", 10240 + 6144 + 48 + 48, 5120, "store"),
        ("gdn ssm_out", 5120, 6144, "accumulate"),
        ("ffn gate+up", 2 * 17408, 5120, "swiglu"),
        ("ffn down", 5120, 17408, "accumulate"),
        ("lm head", 248320, 5120, "store"),
    ],
}


@dataclass(frozen=True)
class GemvTiming:
    name: str
    rows: int
    cols: int
    tokens: int
    mode: str
    seconds: float
    """Per launch."""
    bytes_read: int
    """Weights (quants + fp16 scales), activations (quants + scales) and, when accumulating, the output."""

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes_read / self.seconds / 1e9


def gemv_bytes_read(rows: int, cols: int, tokens: int, mode: str) -> int:
    """What a launch must read: the weight, the activations (fp32 and, when normalised, the norm weight, at
    one token; int8 with scales above) and, when accumulating, the output."""
    out_rows = output_shape(rows, tokens, mode)[1]
    if tokens == 1:
        activations = 4 * cols * (1 if mode == "accumulate" else 2)
    else:
        activations = tokens * (cols + cols // QUANT_BLOCK * 4)
    return weight_bytes(rows, cols) + activations + (tokens * out_rows * 4 if mode == "accumulate" else 0)


def benchmark_gemv(
    rows: int, cols: int, tokens: int = 1, *, mode: str = "store", name: str = "", repeats: int = 30,
    warmup: int = 3, seed: int = 0, cycle_bytes: int = 1 << 30, tiling: FusedGemvTiling | None = None,
) -> GemvTiming:  # fmt: skip
    """Time the Q8_0 GEMV a decode step runs for this shape (needs a GPU): at one token the fused kernel,
    normalising its input unless it accumulates (as the step does), above that the batched kernel."""
    problem = _DeviceProblem(rows, cols, tokens, mode, seed, cycle_bytes)
    seconds = problem.time(tiling or problem.default_tiling, repeats, warmup)
    return GemvTiming(name, rows, cols, tokens, mode, seconds, gemv_bytes_read(rows, cols, tokens, mode))


class _DeviceProblem:
    """Random operands on the GPU, the weight repeated in copies totalling `cycle_bytes`: the launches cycle
    through them, so each launch streams its weight from DRAM as in a decode step instead of finding it in
    L2 (the H200's holds 50 MB)."""

    def __init__(self, rows: int, cols: int, tokens: int, mode: str, seed: int, cycle_bytes: int) -> None:
        rng = np.random.default_rng(seed)
        quants = rng.integers(-127, 128, (rows, cols), dtype=np.int8).view(np.uint32)
        scales = (rng.random((rows, cols // QUANT_BLOCK)) * 0.01).astype(np.float16)
        copies = max(1, -(-cycle_bytes // weight_bytes(rows, cols)))
        self.weights = [(cuda.to_device(quants), cuda.to_device(scales)) for _ in range(copies)]
        self.x = cuda.to_device(rng.standard_normal((tokens, cols)).astype(np.float32))
        self.norm = None if mode == "accumulate" else cuda.to_device(np.ones(cols, np.float32))
        self.x_quants = cuda.to_device(rng.integers(-127, 128, (tokens, cols), dtype=np.int8).view(np.uint32))
        self.x_scales = cuda.to_device(rng.random((tokens, cols // QUANT_BLOCK)).astype(np.float32))
        self.out = cuda.to_device(np.zeros(output_shape(rows, tokens, mode), np.float32))
        self.tokens, self.mode = tokens, mode
        gpu, tuning = bench_gpu()
        self.sm_count = gpu.multiprocessors
        self.early_launch = tuning.launches_early(gpu)
        self.default_tiling = tuning.gemv_tiling(rows, cols, mode, self.sm_count)
        """The one-token tiling a decode step's launch of this shape gets."""

    def time(self, tiling: FusedGemvTiling | None, repeats: int, warmup: int) -> float:
        """Seconds per launch (tiling None: the unfused kernel on the quantised input at any token count)."""
        launches = []
        for quants, scales in self.weights:
            if self.tokens == 1 and tiling is not None:
                launch = gemv_q8_fused_launch(quants, scales, self.x, self.out, mode=self.mode, norm_weight=self.norm,
                                              eps=1e-6, sm_count=self.sm_count, tiling=tiling)  # fmt: skip
            else:
                launch = gemv_q8_launch(quants, scales, self.x_quants, self.x_scales, self.out, mode=self.mode)
            launches.append(launch)
        return time_launches(launches, repeats, warmup, early_launch=self.early_launch) / len(launches)


def random_kquant_copies(
    fmt: KQuantFormat, rows: int, cols: int, rng: np.random.Generator, copies: int
) -> list[KQuantArrays]:
    """`copies` device copies of one matrix of random bits in `fmt`'s layout (a matmul's time does not depend
    on the values)."""
    host = {
        k: rng.integers(0, 256, (n, m * np.dtype(ARRAY_DTYPES[k]).itemsize), dtype=np.uint8).view(ARRAY_DTYPES[k])
        for k, (n, m) in fmt.shapes(rows, cols).items()
    }
    return [KQuantArrays(**{k: cuda.to_device(v) for k, v in host.items()}) for _ in range(copies)]


def benchmark_kquant_gemv(
    type_name: str, rows: int, cols: int, tokens: int, *, mode: str, name: str = "", repeats: int = 30,
    seed: int = 0, cycle_bytes: int = 1 << 30,
) -> GemvTiming:  # fmt: skip
    """Time the 4/5/6-bit GEMV of `type_name` a decode step runs for this shape (needs a GPU): at one token the
    fused kernel on fp32 input, above that the batched one on int8 activations. The weight's arrays are random
    bits (the time does not depend on the values), in copies totalling `cycle_bytes`."""
    fmt = FORMATS[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    weight = fmt.matrix_bytes(rows, cols)
    arrays = random_kquant_copies(fmt, rows, cols, rng, max(1, -(-cycle_bytes // weight)))
    x_quants = cuda.to_device(rng.integers(-127, 128, (tokens, cols), dtype=np.int8).view(np.uint32))
    x_scales = cuda.to_device(rng.random((tokens, cols // QUANT_BLOCK)).astype(np.float32))
    out = cuda.to_device(np.zeros(output_shape(rows, tokens, mode), np.float32))
    gpu, tuning = bench_gpu()
    if tokens == 1:  # what a decode step runs: the fused kernel, normalising its input unless it accumulates
        x = cuda.to_device(rng.standard_normal((1, cols)).astype(np.float32))
        norm = None if mode == "accumulate" else cuda.to_device(np.ones(cols, np.float32))
        tiling = tuning.gemv_tiling(rows, cols, mode, gpu.multiprocessors)
        launches = [gemv_kquant_fused_launch(fmt.tensor_type, a, cols, x, out, mode=mode, norm_weight=norm, eps=1e-6,
                                             sm_count=gpu.multiprocessors, tiling=tiling) for a in arrays]  # fmt: skip
    else:
        launches = [kquant_matmul_launch(fmt.tensor_type, a, cols, x_quants, x_scales, out, mode=mode) for a in arrays]
    seconds = time_launches(launches, repeats, 3, early_launch=tuning.launches_early(gpu)) / len(launches)
    activations = tokens * (cols + cols // QUANT_BLOCK * 4)
    accumulated = tokens * output_shape(rows, tokens, mode)[1] * 4 if mode == "accumulate" else 0
    return GemvTiming(name, rows, cols, tokens, mode, seconds, weight + activations + accumulated)


SWEEP_SHAPES = ((1, 2), (1, 3), (2, 1), (3, 1))
"""(groups of 8 warps per block, blocks per SM) the sweep times: every one fits on an SM at once (at most
`gemv_fused.SM_THREADS` threads)."""


def sweep_tilings(model: str, repeats: int, limit: float) -> None:
    """Time each one-token tiling on every projection of `model` and print which is fastest for a whole step
    (each shape weighted by how often a step runs it), so the default can be chosen by measurement."""
    shape = MODEL_SHAPES[model]
    attention = sum(shape.is_attention(i) for i in range(shape.num_layers))
    runs = {"attn": attention, "gdn": shape.num_layers - attention, "ffn": shape.num_layers, "lm": 1}
    tilings = [FusedGemvTiling(steps, blocks, groups) for steps in STEP_CHOICES for groups, blocks in SWEEP_SHAPES]
    per_step = dict.fromkeys(tilings, 0.0)
    default_per_step = 0.0
    print(f"{model}: one-token tilings (steps s, groups g x blocks per SM) -> µs per launch (% of the read "
          "bandwidth); 'quantised' is the unfused kernel on an already quantised input, the weight stream alone")  # fmt: skip
    for name, rows, cols, mode in QWEN_GEMV_SHAPES[model]:
        problem = _DeviceProblem(rows, cols, 1, mode, 0, 256 << 20)  # 5x the H200's L2: every launch from DRAM
        nbytes = gemv_bytes_read(rows, cols, 1, mode)
        times = {tiling: problem.time(tiling, repeats, 3) for tiling in tilings}
        quantised = problem.time(None, repeats, 3)
        default = times[problem.default_tiling]
        per_token = runs[name.split()[0]]  # launches of this shape in a step
        for tiling, seconds in times.items():
            per_step[tiling] += per_token * seconds
        default_per_step += per_token * default
        best = min(times, key=times.__getitem__)
        row = " ".join(f"{t.label}:{times[t] * 1e6:.1f}" for t in tilings)
        print(f"  {name:24} best {best.label} {nbytes / times[best] / 1e9 / limit:6.1%} "
              f"(default {nbytes / default / 1e9 / limit:6.1%}, quantised {quantised * 1e6:.1f} µs "
              f"{nbytes / quantised / 1e9 / limit:6.1%})  {row}")  # fmt: skip
    best = min(per_step, key=per_step.__getitem__)
    print(f"  whole step: best {best.label} {per_step[best] * 1e3:.3f} ms of GEMV per token; "
          f"default {default_per_step * 1e3:.3f} ms")  # fmt: skip


def fixed_costs(model: str, repeats: int, limit: float) -> None:
    """Print, per one-token projection of `model`, where a launch's time goes beside its streaming time."""
    sm_count = bench_gpu()[0].multiprocessors
    counter = cuda.to_device(np.zeros(1, np.int32))
    empty = time_launches([Launch(count_launch, sm_count, 256, (counter,)) for _ in range(20)], repeats, 3) / 20
    print(f"{model}: an empty launch takes {empty * 1e6:.2f} µs; per projection, µs per launch: the fused launch, "
          "its weight streamed at the read bandwidth, the excess, one row pair alone, the unfused kernel on a "
          "quantised input")  # fmt: skip
    for name, rows, cols, mode in QWEN_GEMV_SHAPES[model]:
        problem = _DeviceProblem(rows, cols, 1, mode, 0, 256 << 20)
        tiling = problem.default_tiling  # the one-pair problem below runs the full shape's tiling
        full, unfused = problem.time(tiling, repeats, 3), problem.time(None, repeats, 3)
        del problem
        one_pair = _DeviceProblem(4 if mode == "swiglu" else 2, cols, 1, mode, 0, 16 << 20).time(tiling, repeats, 3)
        streaming = gemv_bytes_read(rows, cols, 1, mode) / (limit * 1e9)
        print(f"  {name:24} fused {full * 1e6:7.2f}  streaming {streaming * 1e6:7.2f}  excess "
              f"{(full - streaming) * 1e6:5.2f}  one pair {one_pair * 1e6:6.2f}  unfused {unfused * 1e6:7.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shapes_argument(parser, QWEN_GEMV_SHAPES, QWEN_GEMV_SHAPES)
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="time every one-token tiling instead")
    parser.add_argument("--fixed-costs", action="store_true", help="show what a one-token launch pays beside streaming")
    parser.add_argument("--types", nargs="*", choices=[t.name for t in FORMATS], default=[],
                        help="time the 4/5/6-bit GEMV of these types instead of Q8_0's")  # fmt: skip
    args = parser.parse_args(argv)
    from cmpchat.kernels.throughput_probes import streaming_read_bandwidth  # (it imports this module)

    limit = streaming_read_bandwidth() / 1e9
    print(f"streaming read: {limit:.0f} GB/s")
    if args.sweep:
        for model in args.models:
            sweep_tilings(model, args.repeats, limit)
        return
    if args.fixed_costs:
        for model in args.models:
            fixed_costs(model, args.repeats, limit)
        return
    print(f"{'model':5} {'type':5} {'shape':24} {'rows':>7} {'cols':>6} {'T':>3} {'mode':10} {'µs':>9} {'GB/s':>7} "
          f"{'of read':>8}")  # fmt: skip
    for model in args.models:
        for name, rows, cols, mode in QWEN_GEMV_SHAPES[model]:
            for type_name in args.types or ["Q8_0"]:
                for tokens in args.tokens:
                    if type_name == "Q8_0":
                        t = benchmark_gemv(rows, cols, tokens, mode=mode, name=name, repeats=args.repeats)
                    else:
                        t = benchmark_kquant_gemv(type_name, rows, cols, tokens, mode=mode, name=name,
                                                  repeats=args.repeats)  # fmt: skip
                    print(
                        f"{model:5} {type_name:5} {name:24} {rows:7} {cols:6} {tokens:3} {mode:10} "
                        f"{t.seconds * 1e6:9.1f} {t.gigabytes_per_second:7.0f} {t.gigabytes_per_second / limit:8.1%}"
                    )


if __name__ == "__main__":
    main()
