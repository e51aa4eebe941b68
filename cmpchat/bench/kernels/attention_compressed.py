"""Decode attention over each compressed KV format against the fp16 kernel, per layer, at long contexts.

    python -m cmpchat.bench.kernels.attention_compressed [--contexts 32768 131072 262144] [--layout 9B] [--repeats 10]

Batch 1, head size 256, pages of 256, the GPU's row's tiling (`DeviceTuning.decode_attention_config`) for
every format, the cache filled with random codes and scales (the kernels' time does not depend on the
values). Per context it prints each format's step (split-K partials and combine) in µs, its ratio to the fp16
step in the same run (issue 29's mark: tq3 at most 0.3 from 32K to 256K), and the cache bytes the step reads
per second beside the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np
from numba import cuda

from cmpchat.bench.kernels.attention import LAYOUTS, benchmark_decode_attention
from cmpchat.bench.kernels.device import bench_gpu
from cmpchat.bench.kernels.timing import seconds_per_call
from cmpchat.kernels.attention import POSITION_COLUMNS, partial_buffer_shapes
from cmpchat.kernels.attention_compressed import compressed_decode_attention
from cmpchat.kernels.kv_codes import GPU_FORMATS

PAGE_TOKENS = 256
HEAD_DIM = 256


def benchmark_compressed_attention(
    format_name: str, *, num_heads: int, num_kv_heads: int, context: int, repeats: int, seed: int = 0
) -> dict[str, float]:
    """GPU seconds of one decode-attention step over a `format_name` cache of `context` tokens, and the bytes
    it reads."""
    gpu, tuning = bench_gpu()
    config = tuning.decode_attention_config(1, num_heads, num_kv_heads, gpu.multiprocessors)
    rng = np.random.default_rng(seed)
    pages = -(-context // PAGE_TOKENS)
    caches, cache_bytes = [], 0
    for codec in GPU_FORMATS[format_name]:
        lead = (pages, PAGE_TOKENS, num_kv_heads)
        codes = cuda.device_array((*lead, codec.codes_per_vector(HEAD_DIM)), codec.code_dtype)
        scales = cuda.device_array((*lead, codec.scales_per_vector(HEAD_DIM)), codec.scale_dtype)
        code_bytes = (1, *codes.shape[1:-1], codes.shape[-1] * np.dtype(codec.code_dtype).itemsize)
        code_page: np.ndarray = rng.integers(0, 256, code_bytes, np.uint8).view(codec.code_dtype)
        scale_page: np.ndarray = rng.uniform(0.01, 0.1, (1, *scales.shape[1:])).astype(codec.scale_dtype)
        for index in range(pages):
            codes[index : index + 1].copy_to_device(code_page)
            scales[index : index + 1].copy_to_device(scale_page)
        caches += [codes, scales]
        cache_bytes += context * num_kv_heads * codec.bytes_per_vector(HEAD_DIM)
    positions = np.full((1, POSITION_COLUMNS), context - 1, np.int32)
    table = np.arange(pages, dtype=np.int32).reshape(1, pages)
    q = rng.standard_normal((1, num_heads, HEAD_DIM)).astype(np.float32)
    qkv = rng.standard_normal((1, 2 * (num_heads + num_kv_heads) * HEAD_DIM)).astype(np.float32)
    q_d, qkv_d, positions_d, table_d = (cuda.to_device(a) for a in (q, qkv, positions, table))
    acc_shape, ml_shape = partial_buffer_shapes(1, num_heads, HEAD_DIM, config)
    acc, ml, out = (cuda.device_array(s, np.float32) for s in (acc_shape, ml_shape, (1, num_heads * HEAD_DIM)))
    partial, combine = compressed_decode_attention(
        q_d, qkv_d, positions_d, table_d, tuple(caches), format_name, acc, ml, out, config
    )

    def step() -> None:
        partial.run()
        combine.run()

    seconds = seconds_per_call(step, repeats)
    return {"step_seconds": seconds, "cache_bytes": float(cache_bytes), "gbps": cache_bytes / seconds / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 262144])
    parser.add_argument("--layout", choices=[name.split()[0] for name in LAYOUTS], default="9B")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    heads, kv_heads = next(shape for name, shape in LAYOUTS.items() if name.startswith(args.layout))
    gpu, _ = bench_gpu()
    print(
        f"{gpu.name}: decode attention per layer, {args.layout} layout ({heads} query heads over {kv_heads}), batch 1"
    )
    for context in args.contexts:
        fp16 = benchmark_decode_attention(
            batch=1, num_heads=heads, num_kv_heads=kv_heads, context=context, repeats=args.repeats
        )
        copy = fp16["copy_gbps"]
        cells = [f"f16 {fp16['step_seconds'] * 1e6:7.1f} µs ({fp16['step_kv_gbps'] / copy:5.1%} of copy)"]
        for name in GPU_FORMATS:
            result = benchmark_compressed_attention(
                name, num_heads=heads, num_kv_heads=kv_heads, context=context, repeats=args.repeats
            )
            ratio = result["step_seconds"] / fp16["step_seconds"]
            cells.append(
                f"{name} {result['step_seconds'] * 1e6:7.1f} µs = {ratio:.3f}x f16 ({result['gbps'] / copy:5.1%} of copy)"
            )
        print(f"context {context:>6}: " + "; ".join(cells) + f"; copy {copy:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
