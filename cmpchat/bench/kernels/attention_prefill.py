"""Prefill attention on the GPU against the FFMA peak measured in the same run.

python -m cmpchat.bench.kernels.attention_prefill [9B 27B] [--context 256 4096 16384 65536] [--rows 256]
"""

from __future__ import annotations

import argparse

import numpy as np
from numba import cuda

from cmpchat.bench.kernels import add_shapes_argument
from cmpchat.bench.kernels.device import bench_gpu
from cmpchat.bench.kernels.timing import seconds_per_call
from cmpchat.kernels.attention import POSITION_COLUMNS
from cmpchat.kernels.attention_prefill import (
    PrefillAttentionConfig,
    causal_fmas,
    partial_buffer_shapes,
    prefill_attention,
)

SHAPES = {"9B": (16, 4), "27B": (24, 4)}  # (H, Hkv), hd 256


def benchmark_prefill_attention(
    *,
    num_heads: int,
    num_kv_heads: int,
    context: int,
    rows: int = 256,
    head_dim: int = 256,
    page_tokens: int = 4096,
    config: PrefillAttentionConfig | None = None,
    repeats: int = 10,
    seed: int = 0,
) -> dict[str, float]:
    """Time one prefill-attention step (GPU only): `rows` rows ending at cache index context - 1.

    fma_rate: the causal QK and P.V FMAs (`causal_fmas`) per second of the two launches together. `config`
    defaults to the GPU's row's (`DeviceTuning.prefill_attention_config`).
    """
    gpu, tuning = bench_gpu()
    config = config or tuning.prefill_attention_config(rows, num_heads, num_kv_heads, gpu.multiprocessors)
    rng = np.random.default_rng(seed)
    pages = -(-context // page_tokens)
    shape = (pages, page_tokens, num_kv_heads, head_dim)
    k_cache, v_cache = cuda.device_array(shape, np.float16), cuda.device_array(shape, np.float16)
    page = rng.standard_normal((1, *shape[1:])).astype(np.float16)
    for index in range(pages):
        k_cache[index : index + 1].copy_to_device(page)
        v_cache[index : index + 1].copy_to_device(page)
    first = max(0, context - rows)
    positions = np.zeros((rows, POSITION_COLUMNS), np.int32)
    positions[:, 0] = np.arange(first, first + rows)
    positions[:, 0][positions[:, 0] >= context] = -1
    page_table = np.tile(np.arange(pages, dtype=np.int32), (rows, 1))
    q = rng.standard_normal((rows, num_heads, head_dim)).astype(np.float32)
    qkv = rng.standard_normal((rows, 2 * (num_heads + num_kv_heads) * head_dim)).astype(np.float32)
    q_d, qkv_d, positions_d, table_d = (cuda.to_device(a) for a in (q, qkv, positions, page_table))
    acc_shape, ml_shape = partial_buffer_shapes(rows, num_heads, head_dim, config)
    acc, ml, out = (cuda.device_array(s, np.float32) for s in (acc_shape, ml_shape, (rows, num_heads * head_dim)))
    partial, combine = prefill_attention(q_d, qkv_d, positions_d, table_d, k_cache, v_cache, acc, ml, out, config)

    def step() -> None:
        partial.run()
        combine.run()

    step_seconds = seconds_per_call(step, repeats)
    partial_seconds = seconds_per_call(partial.run, repeats)
    fmas = causal_fmas(positions[:, 0], num_heads, head_dim)
    return {
        "num_splits": float(config.num_splits),
        "step_seconds": step_seconds,
        "partial_seconds": partial_seconds,
        "fmas": float(fmas),
        "fma_rate": fmas / step_seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time prefill attention (256 rows ending at each context).")
    add_shapes_argument(parser, sorted(SHAPES), ["9B", "27B"])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 4096, 16384, 65536])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    from cmpchat.kernels.throughput_probes import FFMA_PROBE, FLOPS_PER_FFMA, compute_rate

    peak = compute_rate(FFMA_PROBE) / FLOPS_PER_FFMA
    print(f"FFMA peak measured now: {peak / 1e12:.2f} T FMA/s ({peak * 2 / 1e12:.1f} TFLOP/s)")
    for model in args.models:
        heads, kv_heads = SHAPES[model]
        for context in args.context:
            result = benchmark_prefill_attention(
                num_heads=heads, num_kv_heads=kv_heads, context=context, rows=args.rows, repeats=args.repeats
            )
            rate = result["fma_rate"]
            print(
                f"{model} context {context:6d}: {result['step_seconds'] * 1e6:9.1f} µs per step "
                f"(partial {result['partial_seconds'] * 1e6:9.1f} µs, {int(result['num_splits'])} splits), "
                f"{rate / 1e12:6.2f} T FMA/s = {rate / peak:6.1%} of FFMA peak",
                flush=True,
            )


if __name__ == "__main__":
    main()
