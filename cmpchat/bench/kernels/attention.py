"""Which decode-attention tiling is fastest on this GPU: every (warps, unroll) at the Qwen3.5 head layouts.

    python -m cmpchat.bench.kernels.attention [--contexts 4096 32768] [--repeats 10]

For G = 4 (0.8B-9B: 16 query heads over 4 KV heads) and G = 6 (27B: 24 over 4), head size 256, batch 1,
it times the split-K partial kernel of each tiling (split count, warps, unroll) with
`benchmark_decode_attention` and prints the K/V bytes it reads per second beside the device-to-device copy
bandwidth measured in the same run, then the fastest tiling over the contexts, so the device table's decode
attention tiling (`DeviceTuning.decode_attention`, `device_table.py`) can be set by measurement (at 32K tokens the
partial kernel reads 30% (G=6) to 45% (G=4) of the H200's bandwidth, 2026-12-01). The default it compares with is
the GPU's row's (CMPCHAT_TUNING=sm_70: another row's).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from numba import cuda

from cmpchat.bench.kernels.device import bench_gpu
from cmpchat.bench.kernels.timing import seconds_per_call
from cmpchat.kernels.attention import (
    POSITION_COLUMNS,
    DecodeAttentionConfig,
    decode_attention,
    partial_buffer_shapes,
)

LAYOUTS = {"9B (G=4)": (16, 4), "27B (G=6)": (24, 4)}
WARPS = (2, 4, 8)
UNROLLS = (2, 4, 8)
BLOCKS_PER_SM = (2, 4, 8)
"""Split counts are sized to give each SM this many blocks (`DecodeAttentionConfig.splits_for`; the device table
chooses one per G: `DeviceTuning.split_blocks_per_sm`)."""


def benchmark_decode_attention(
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    context: int,
    head_dim: int = 256,
    page_tokens: int = 256,
    config: DecodeAttentionConfig | None = None,
    repeats: int = 20,
    seed: int = 0,
) -> dict[str, float]:
    """Time decode attention (GPU only) with every row at `context` tokens; seconds and GB/s. `config`
    defaults to the GPU's row's (`DeviceTuning.decode_attention_config`).

    kv_gbps: the K and V bytes the step must read (batch*context*Hkv*hd*4) over the partial kernel's time.
    copy_gbps: a device-to-device copy of as many bytes in the same run, read + write counted: the limit
    to compare with (docs/testing.md, "How figures are reported").
    """
    gpu, tuning = bench_gpu()
    config = config or tuning.decode_attention_config(batch, num_heads, num_kv_heads, gpu.multiprocessors)
    rng = np.random.default_rng(seed)
    pages_per_row = -(-context // page_tokens)
    shape = (batch * pages_per_row, page_tokens, num_kv_heads, head_dim)
    k_cache, v_cache = cuda.device_array(shape, np.float16), cuda.device_array(shape, np.float16)
    page = rng.standard_normal((1, *shape[1:])).astype(np.float16)
    for index in range(shape[0]):
        k_cache[index : index + 1].copy_to_device(page)
        v_cache[index : index + 1].copy_to_device(page)
    positions = np.full((batch, POSITION_COLUMNS), context - 1, np.int32)
    page_table = np.arange(shape[0], dtype=np.int32).reshape(batch, pages_per_row)
    q = rng.standard_normal((batch, num_heads, head_dim)).astype(np.float32)
    qkv = rng.standard_normal((batch, 2 * (num_heads + num_kv_heads) * head_dim)).astype(np.float32)
    q_d, qkv_d, positions_d, table_d = (cuda.to_device(a) for a in (q, qkv, positions, page_table))
    acc_shape, ml_shape = partial_buffer_shapes(batch, num_heads, head_dim, config)
    acc, ml, out = (cuda.device_array(s, np.float32) for s in (acc_shape, ml_shape, (batch, num_heads * head_dim)))
    partial, combine = decode_attention(q_d, qkv_d, positions_d, table_d, k_cache, v_cache, acc, ml, out, config)
    kv_bytes = batch * context * num_kv_heads * head_dim * 2 * 2
    source, target = (cuda.device_array(max(kv_bytes, 1 << 28), np.uint8) for _ in range(2))

    def step() -> None:
        partial.run()
        combine.run()

    step_seconds = seconds_per_call(step, repeats)
    partial_seconds = seconds_per_call(partial.run, repeats)
    copy_seconds = seconds_per_call(lambda: target.copy_to_device(source), repeats)
    return {
        "num_splits": float(config.num_splits),
        "step_seconds": step_seconds,
        "partial_seconds": partial_seconds,
        "kv_bytes": float(kv_bytes),
        "kv_gbps": kv_bytes / partial_seconds / 1e9,
        "step_kv_gbps": kv_bytes / step_seconds / 1e9,
        "copy_gbps": 2 * source.size / copy_seconds / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    gpu, tuning = bench_gpu()
    sm_count = gpu.multiprocessors
    for layout, (heads, kv_heads) in LAYOUTS.items():
        default = tuning.decode_attention_config(1, heads, kv_heads, sm_count)
        totals: dict[DecodeAttentionConfig, float] = {}
        for blocks in BLOCKS_PER_SM:
            for warps in WARPS:
                for unroll in UNROLLS:
                    config = replace(DecodeAttentionConfig.splits_for(1, kv_heads, sm_count, blocks), warps=warps,
                                     unroll=unroll)  # fmt: skip
                    cells = []
                    for context in args.contexts:
                        result = benchmark_decode_attention(batch=1, num_heads=heads, num_kv_heads=kv_heads,
                                                            context=context, config=config, repeats=args.repeats)  # fmt: skip
                        totals[config] = totals.get(config, 0.0) + result["partial_seconds"]
                        share = result["kv_gbps"] / result["copy_gbps"]
                        cells.append(f"{context}: {result['partial_seconds'] * 1e6:7.1f} µs {share:6.1%} of copy")
                    print(f"{layout} splits {config.num_splits} warps {warps} unroll {unroll}: " + ", ".join(cells),
                          flush=True)  # fmt: skip
        best = min(totals, key=totals.__getitem__)
        print(f"{layout}: fastest splits {best.num_splits} warps {best.warps} unroll {best.unroll} "
              f"({totals[best] * 1e6:.1f} µs over the contexts; default {default.num_splits}/{default.warps}/"
              f"{default.unroll}: {totals[default] * 1e6:.1f} µs)")  # fmt: skip


if __name__ == "__main__":
    main()
