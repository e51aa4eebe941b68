"""Chunked against token-by-token Gated DeltaNet prefill on the GPU: `python -m cmpchat.bench.kernels.gdn_chunked`."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, GatedDeltaNetWeights, decode_step
from cmpchat.kernels.gated_deltanet_chunked.common import CHUNK_SIZES, DEFAULT_CHUNK
from cmpchat.kernels.gated_deltanet_chunked.launch import ChunkWorkspace, prefill_launches


def benchmark_prefill(
    shape: GatedDeltaNetShape,
    tokens: int,
    *,
    chunk: int = DEFAULT_CHUNK,
    replays: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """GPU time of one layer's prefill of `tokens` tokens, chunked and token by token, in µs.

    Each variant's launches are replayed from a CUDA graph (`cmpchat.cudart.profile.profile_launches`: no
    launch overhead in the figures): `<variant>_us` is a whole replay, `<kernel>_us` each kernel's share.
    `speedup` is token by token over chunked for the whole layer, `recurrence_speedup` the same for the
    recurrence alone (prepare + state pass + output against the token loop). `decode_prompt_us` times the decode
    kernels' prompt mode (`decode_step(..., tokens_per_sequence=T)`, what the backend's prompt chunks run).
    """
    from cmpchat.cudart.profile import profile_launches

    rng = np.random.default_rng(seed)
    f32 = np.float32
    weights = GatedDeltaNetWeights(
        cuda.to_device((0.3 * rng.standard_normal((shape.conv_dim, shape.conv_kernel))).astype(f32)),
        cuda.to_device(-np.exp(rng.standard_normal(shape.num_v_heads)).astype(f32)),
        cuda.to_device(rng.standard_normal(shape.num_v_heads).astype(f32)),
        cuda.to_device((1.0 + 0.1 * rng.standard_normal(shape.v_head_dim)).astype(f32)),
    )
    projection = cuda.to_device(rng.standard_normal((tokens, shape.projection_width)).astype(f32))
    conv_state = cuda.to_device(np.zeros((1, shape.conv_kernel - 1, shape.conv_dim), f32))
    delta_state = cuda.to_device(np.zeros((1, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim), f32))
    out = cuda.device_array((tokens, shape.output_width), f32)
    mixed = cuda.device_array((tokens, shape.conv_dim), f32)
    workspace = ChunkWorkspace.allocate(shape, tokens, chunk)
    arguments = (shape, weights, projection, conv_state, delta_state, 0, out)
    variants = {
        "chunked": prefill_launches(*arguments, chunk=chunk, mixed=mixed, workspace=workspace),
        "sequential": prefill_launches(*arguments, chunked=False, mixed=mixed),
    }
    slots = cuda.to_device(np.zeros(tokens, np.int32))
    variants["decode_prompt"] = list(decode_step(*arguments[:5], slots, out, mixed, tokens_per_sequence=tokens))

    stream = cuda.stream()
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk}
    for name, launches in variants.items():
        for launch in launches:  # compile and warm up
            launch.run(stream)
        stream.synchronize()
        timings = profile_launches(launches, stream, replays=replays)
        result[f"{name}_us"] = 1e6 * timings.replay
        for kernel_name, seconds in zip(timings.names, timings.attributed(), strict=True):
            result[f"{kernel_name}_us"] = 1e6 * seconds
    result["chunked_recurrence_us"] = sum(
        result[f"{name}_us"] for name in ("gdn_chunk_prepare", "gdn_chunk_state", "gdn_chunk_output")
    )
    result["sequential_recurrence_us"] = result["gdn_prefill_sequential_us"]
    result["speedup"] = result["sequential_us"] / result["chunked_us"]
    result["recurrence_speedup"] = result["sequential_recurrence_us"] / result["chunked_recurrence_us"]
    return result


def main(argv: list[str] | None = None) -> int:
    from cmpchat.model.builder import MODEL_SHAPES

    parser = argparse.ArgumentParser(
        prog="python -m cmpchat.bench.kernels.gdn_chunked",
        description="Time one GDN layer's prefill on the GPU: chunked (WY) against token by token.",
    )
    parser.add_argument("models", nargs="+", choices=sorted(MODEL_SHAPES), help="model shapes, e.g. 9B 27B")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1160, 4620, 16384])
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, choices=CHUNK_SIZES)
    parser.add_argument("--replays", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"{'model':>6} {'tokens':>7} {'chunked us':>11} {'token us':>10} {'ratio':>6}   "
        f"{'prepare':>9} {'state':>9} {'output':>9} {'token rec':>9} {'rec ratio':>9} {'conv':>8} {'norm':>8} "
        f"{'decode':>10}"
    )
    for name in args.models:
        model = MODEL_SHAPES[name]
        shape = GatedDeltaNetShape(
            model.num_k_heads, model.num_v_heads, model.k_head_dim, model.v_head_dim, model.conv_kernel, model.rms_eps
        )
        for tokens in args.tokens:
            r = benchmark_prefill(shape, tokens, chunk=args.chunk, replays=args.replays)
            print(
                f"{name:>6} {tokens:>7} {r['chunked_us']:>11.1f} {r['sequential_us']:>10.1f} {r['speedup']:>6.2f}   "
                f"{r['gdn_chunk_prepare_us']:>9.1f} {r['gdn_chunk_state_us']:>9.1f} {r['gdn_chunk_output_us']:>9.1f} "
                f"{r['sequential_recurrence_us']:>9.1f} {r['recurrence_speedup']:>9.2f} "
                f"{r['gdn_prefill_conv_us']:>8.1f} {r['gdn_prefill_gated_norm_us']:>8.1f} "
                f"{r['decode_prompt_us']:>10.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
