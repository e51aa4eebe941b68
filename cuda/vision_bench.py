#!/usr/bin/env python3
"""Issue 31's mark: the image encoder on this GPU at the released shape, timed, with a labelled CMP projection.

    python3 cuda/vision_bench.py [--replays 5] [--check] [--json FILE] [--size 1280x720] [--depth 27]

A random projector of the released shape (`gpu_encoder.RELEASED_9B`: 27 blocks of width 1152, 16 heads of 72,
MLP 4304, merger 4608 -> 4096; no file needed) encodes a 1280x720 image (44 x 80 patches = 3520, 880 merged
tokens). Printed:

- the encode's GPU time: its launches replayed as a CUDA graph (`cudart.profile.profile_launches`), per family:
  GEMM (the DP4A prefill GEMM), attention (fp32 FMA) and the rest (memory-bound row kernels);
- `GpuImageEncoder.encode` end to end on the host clock (pixel upload, ~300 Numba launches, rows back);
- this GPU's dp4a and FFMA rates and streaming-read bandwidth, measured now (`kernels.throughput_probes`);
- the labelled CMP 100-210 projection, each family scaled by the ratio of this GPU's rate to the CMP's:

      CMP seconds = GEMM s x (dp4a/s here / 4.3e12) + attention s x (FMA/s here / 5.0e12)
                    + other s x (read bytes/s here / 818e9)

  with the CMP's figures of docs/hardware.md (DP4A 17.2 TOPS = 4.3e12 dp4a/s; FP32 ~10 TFLOP = 5e12 FMA/s;
  818 GB/s), so each family keeps the share of its own limit it reaches here. Information, not a measurement;
  the CMP's link (PCIe Gen1 x1, ~250 MB/s) is projected apart: the pixels up (one frame of a still image,
  10.8 MB) and, where the rows are used on the host, the rows down (14.4 MB).

`--check` also runs the numpy fp32 reference on the same image (a minute or so on the CPU) and prints the
int8 path's error against it. `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CMP_DP4A_PER_SECOND = 4.3e12
CMP_FMA_PER_SECOND = 5.0e12
CMP_READ_BANDWIDTH = 818e9
CMP_LINK_BYTES_PER_SECOND = 250e6
MARK_SECONDS = 0.6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=5, help="graph replays the per-launch times are medians of")
    parser.add_argument("--check", action="store_true", help="also compare with the numpy fp32 reference")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--size", default="1280x720", help="the image's width x height (the mark's: 1280x720)")
    parser.add_argument("--depth", type=int, help="blocks (default the released 27; fewer for a quick look)")
    args = parser.parse_args(argv)
    width, height = (int(side) for side in args.size.lower().split("x"))

    from numba import cuda
    from PIL import Image

    from cmpchat.cudart.profile import profile_launches
    from cmpchat.kernels.throughput_probes import (
        DP4A_PROBE,
        FFMA_PROBE,
        FLOPS_PER_FFMA,
        OPS_PER_DP4A,
        compute_rate,
        streaming_read_bandwidth,
    )
    from cmpchat.kernels.vision import attention_fmas
    from cmpchat.vision.gpu_encoder import ATTENTION, GEMM, RELEASED_9B, GpuImageEncoder, random_projector
    from cmpchat.vision.preprocess import PixelBudget, prepare_image

    config = RELEASED_9B if args.depth is None else replace(RELEASED_9B, depth=args.depth)
    started = time.perf_counter()
    projector = random_projector(config)
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    image = prepare_image(picture, config.patch_settings, PixelBudget())
    patches = image.grid.frames * image.grid.rows * image.grid.cols
    merged = image.grid.merged_tokens(config.merge_size)
    print(
        f"image {width}x{height} -> grid {image.grid.rows}x{image.grid.cols}: {patches} patches, {merged} merged tokens"
    )
    encoder = GpuImageEncoder(projector)
    attention = encoder.attention
    print(f"projector built and uploaded in {time.perf_counter() - started:.1f} s (GEMM tiling {encoder.tiling.label}, "
          f"attention {attention.warps} warps: {attention.tile_queries} queries x 32-key tiles)")  # fmt: skip

    rows = encoder.encode(image)  # compiles every kernel
    assert rows.shape == (merged, config.projection_dim) and np.isfinite(rows).all()
    walls = []
    for _ in range(3):
        began = time.perf_counter()
        encoder.encode(image)
        walls.append(time.perf_counter() - began)
    wall = min(walls)

    launches = encoder.prepare(image)
    timings = profile_launches([launch for _, launch in launches], encoder.stream, replays=args.replays)
    attributed = timings.attributed()
    families: dict[str, float] = {}
    for (family, _), seconds in zip(launches, attributed, strict=True):
        families[family] = families.get(family, 0.0) + seconds
    kernel_seconds = timings.replay

    dp4a = compute_rate(DP4A_PROBE) / OPS_PER_DP4A
    fma = compute_rate(FFMA_PROBE) / FLOPS_PER_FFMA
    bandwidth = streaming_read_bandwidth()
    factors = {GEMM: dp4a / CMP_DP4A_PER_SECOND, ATTENTION: fma / CMP_FMA_PER_SECOND}
    read_factor = bandwidth / CMP_READ_BANDWIDTH
    cmp_families = {name: seconds * factors.get(name, read_factor) for name, seconds in families.items()}
    cmp_seconds = sum(cmp_families.values())
    # the GEMM's arguments end (rows, words per row, tokens, mode): rows x 4 words x tokens multiply-adds
    gemm_macs = sum(int(launch.args[5]) * 4 * int(launch.args[6]) * int(launch.args[7])
                    for family, launch in launches if family == GEMM)  # fmt: skip
    fmas = config.depth * attention_fmas(patches, config.num_heads, config.head_dim)
    pixel_bytes = patches * 3 * config.patch_size**2 * 4
    row_bytes = rows.nbytes

    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    print(f"\nGPU: {name}; measured now: {dp4a / 1e12:.2f}e12 dp4a/s ({dp4a * OPS_PER_DP4A / 1e12:.0f} TOPS at 8 ops), "
          f"{fma / 1e12:.2f}e12 FMA/s ({fma * 2 / 1e12:.1f} TFLOP/s), read {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print(f"encode, GPU time (graph replay of {len(launches)} launches): {kernel_seconds * 1e3:.2f} ms")
    for family, seconds in families.items():
        rate = ""
        if family == GEMM:
            rate = f"  {gemm_macs / 4 / seconds / dp4a:.1%} of the dp4a peak ({gemm_macs / 1e12:.2f} T MACs)"
        elif family == ATTENTION:
            rate = f"  {fmas / seconds / fma:.1%} of the FFMA peak ({fmas / 1e12:.2f} T FMAs)"
        print(f"  {family:10s} {seconds * 1e3:9.2f} ms  -> CMP {cmp_families[family] * 1e3:8.1f} ms{rate}")
    print(f"encode() end to end on the host clock: {wall * 1e3:.2f} ms (pixels up, launches, rows down)")
    verdict = "within" if cmp_seconds <= MARK_SECONDS else "OVER"
    print(f"\nCMP 100-210 projection (labelled, not measured): encode {cmp_seconds:.3f} s on the GPU, {verdict} the "
          f"mark of {MARK_SECONDS} s")  # fmt: skip
    print(f"  formula: GEMM s x {factors[GEMM]:.2f} (dp4a/s here / 4.3e12) + attention s x {factors[ATTENTION]:.2f} "
          f"(FMA/s here / 5.0e12) + other s x {read_factor:.2f} (read here / 818 GB/s)")  # fmt: skip
    print(f"  the CMP's link (250 MB/s): pixels up {pixel_bytes / CMP_LINK_BYTES_PER_SECOND * 1e3:.0f} ms; rows down, "
          f"if the host takes them, {row_bytes / CMP_LINK_BYTES_PER_SECOND * 1e3:.0f} ms")  # fmt: skip

    result = {
        "gpu": name, "patches": patches, "merged_tokens": merged, "launches": len(launches),
        "gpu_seconds": kernel_seconds, "families_seconds": families, "encode_wall_seconds": wall,
        "dp4a_per_second": dp4a, "fma_per_second": fma, "read_bandwidth": bandwidth,
        "cmp_families_seconds": cmp_families, "cmp_seconds": cmp_seconds, "mark_seconds": MARK_SECONDS,
        "cmp_link_pixels_seconds": pixel_bytes / CMP_LINK_BYTES_PER_SECOND,
        "cmp_link_rows_seconds": row_bytes / CMP_LINK_BYTES_PER_SECOND,
        "gemm_macs": gemm_macs, "attention_fmas": fmas, "attention_warps": attention.warps,
        "per_launch": [[family, launch_name, seconds] for (family, _), launch_name, seconds in
                       zip(launches, timings.names, attributed, strict=True)][:24],
    }  # fmt: skip
    if args.check:
        from cmpchat.vision.encoder import encode_image

        began = time.perf_counter()
        reference = encode_image(projector, image)
        difference = rows - reference
        result["max_error"] = float(np.abs(difference).max())
        result["rms_error"] = float(np.sqrt((difference**2).mean() / (reference**2).mean()))
        result["reference_max"] = float(np.abs(reference).max())
        print(f"\nagainst the numpy fp32 reference ({time.perf_counter() - began:.0f} s): max |error| "
              f"{result['max_error']:.4f} on values up to {result['reference_max']:.2f}, RMS "
              f"{result['rms_error']:.2%} of the rows' RMS")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
