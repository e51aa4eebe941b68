"""Which decode-attention tiling is fastest on this GPU: every (warps, unroll) at the Qwen3.5 head layouts.

    python -m cmpchat.cuda.kernels.attention_bench [--contexts 4096 32768] [--repeats 10]

For G = 4 (0.8B-9B: 16 query heads over 4 KV heads) and G = 6 (27B: 24 over 4), head size 256, batch 1,
it times the split-K partial kernel of each tiling (split count, warps, unroll) with
`benchmark_decode_attention` and prints the K/V bytes it reads per second beside the device-to-device copy
bandwidth measured in the same run, then the fastest tiling over the contexts, so `DecodeAttentionConfig`'s
defaults can be set by measurement (at 32K tokens the partial kernel reads 30% (G=6) to 45% (G=4) of
the H200's bandwidth, 2026-12-01).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from numba import cuda

from cmpchat.cuda.kernels.attention import DecodeAttentionConfig, benchmark_decode_attention

LAYOUTS = {"9B (G=4)": (16, 4), "27B (G=6)": (24, 4)}
WARPS = (2, 4, 8)
UNROLLS = (2, 4, 8)
BLOCKS_PER_SM = (2, 4, 8)
"""Split counts are sized to give each SM this many blocks (`DecodeAttentionConfig.splits_for`)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT
    for layout, (heads, kv_heads) in LAYOUTS.items():
        default = DecodeAttentionConfig.splits_for(1, heads, kv_heads, sm_count)
        totals: dict[DecodeAttentionConfig, float] = {}
        for blocks in BLOCKS_PER_SM:
            for warps in WARPS:
                for unroll in UNROLLS:
                    config = replace(DecodeAttentionConfig.splits_for(1, heads, kv_heads, sm_count, blocks), warps=warps,
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
