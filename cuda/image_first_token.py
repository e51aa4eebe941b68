#!/usr/bin/env python3
"""Issue 31's end-to-end mark: from an attached 1280x720 image to the first token, on the 9B bench shape.

    python3 cuda/image_first_token.py [--trials 3] [--text 24] [--json FILE]

The 9B bench file (`cmpchat bench`'s random Q8_0 weights of the released shapes, built on first use) is loaded
on the CUDA backend with a random projector of the released shape (`gpu_encoder.RELEASED_9B`) reserved in the
first stage's memory plan, as `open_model` does. Each trial attaches a new random 1280x720 PNG (so the encoder's
cache misses) and times, on the host clock, what a user waits for:

- encode: the PNG's bytes to the image's 880 rows (`ImageEncoder.encode`: decode, resize, the GPU encoder,
  the rows back to the host);
- prefill: the prompt (`--text` text tokens, the image's pads, `--text` more) in the engine's 512-token chunks
  with the image's rows and (t, h, w) positions (`prefill_with_images`), to the prefill's logits;
- first token: the greedy selection on the GPU from those logits, waited for;
- first decode: the decode step that reads that token, and its selection.

The fastest trial is printed, then a labelled CMP 100-210 projection (information, not a measurement): the
encode's launches and the prompt's long-prompt steps profiled by kernel family, each family scaled by the ratio
of this GPU's measured rate to the CMP's (the benches' constants: the GEMMs by dp4a/s, `bench.prefill`; the
encoder's attention by FMA/s, `cuda/vision_bench.py`; the rest by read bandwidth, `bench.limits`); the prompt's
tail steps, the selection and the decode step at read bandwidth; the image's crossings of the CMP's link (PCIe
Gen1 x1, `cuda/vision_bench.py`): the pixels up, the rows down to the host and back up to the first stage.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZE = (1280, 720)
PREFILL_CHUNK = 512
"""The engine's default prompt tokens per prefill call (`open_model(prefill_chunk=)`)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="images attached, after one that compiles")
    parser.add_argument("--text", type=int, default=24, help="text tokens before and after the image")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    from PIL import Image
    from vision_bench import CMP_FMA_PER_SECOND, CMP_LINK_BYTES_PER_SECOND

    from cmpchat.api import CUDA_IMAGE_MAX_PIXELS
    from cmpchat.backends.base import Selector
    from cmpchat.backends.gpu.model import CudaBackend
    from cmpchat.bench.kernel_families import family_times
    from cmpchat.bench.limits import CMP_READ_BANDWIDTH
    from cmpchat.bench.model_files import bench_model_path
    from cmpchat.bench.prefill import CMP_DP4A_PER_SECOND, PrefillRates, PrefillRun
    from cmpchat.cudart.profile import profile_launches
    from cmpchat.kernels.throughput_probes import (
        DP4A_PROBE,
        FFMA_PROBE,
        FLOPS_PER_FFMA,
        OPS_PER_DP4A,
        compute_rate,
        streaming_read_bandwidth,
    )
    from cmpchat.model.gguf_file import ModelFile
    from cmpchat.paths import cache_dir
    from cmpchat.sampling import SamplingParams
    from cmpchat.vision.gpu_encoder import (
        ATTENTION,
        GEMM,
        RELEASED_9B,
        GpuImageEncoder,
        device_bytes,
        random_projector,
    )
    from cmpchat.vision.image_encoder import ImageEncoder
    from cmpchat.vision.preprocess import PixelBudget, prepare_image
    from cmpchat.vision.prompt_images import PromptImages

    rates = PrefillRates(streaming_read_bandwidth(), compute_rate(DP4A_PROBE) / OPS_PER_DP4A)
    fma = compute_rate(FFMA_PROBE) / FLOPS_PER_FFMA
    budget = PixelBudget(max_pixels=CUDA_IMAGE_MAX_PIXELS)
    projector = random_projector(RELEASED_9B)
    encoder_bytes = device_bytes(RELEASED_9B, budget.max_pixels // RELEASED_9B.patch_size**2)
    path = bench_model_path("9B", cache_dir() / "bench")
    backend = CudaBackend(ModelFile(path), sequences=1, saved_states=0, context=4096,
                          image_encoder_bytes=encoder_bytes)  # fmt: skip
    backend.warm_up()
    print("\n".join(backend.describe()))
    gpu_encoder = GpuImageEncoder(projector, gpu_index=backend.stages[0].gpu.index)  # as `ImageEncoder.on_gpu`
    images = ImageEncoder(projector, budget, encode=gpu_encoder.encode)
    greedy = [Selector(SamplingParams(), [], np.random.default_rng(0))]
    rng = np.random.default_rng(0)
    image_pad = backend.config.vocab_size - 1  # any id: its embedding is never read

    def attach() -> tuple[dict[str, float], PromptImages, list[int]]:
        picture = Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8))
        png = io.BytesIO()
        picture.save(png, format="PNG")
        text = [int(t) for t in rng.integers(0, image_pad, 2 * args.text)]
        marks = [time.perf_counter()]
        encoded = images.encode(png.getvalue())
        marks.append(time.perf_counter())
        template = text[: args.text] + [image_pad] + text[args.text :]
        tokens, placed = PromptImages.place(template, [encoded], image_pad, RELEASED_9B.merge_size)
        sequence = backend.new_sequence()
        for start in range(0, len(tokens), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(tokens))
            positions, rows = placed.step_inputs(start, end)
            logits = backend.prefill_with_images(sequence, tokens[start:end], positions=positions, images=rows)
        backend.synchronize()
        marks.append(time.perf_counter())
        selection = backend.select(logits, greedy)
        first = selection.tokens()[0]
        marks.append(time.perf_counter())
        backend.select(backend.decode([sequence], [first]), greedy).tokens()
        marks.append(time.perf_counter())
        backend.release(sequence)
        phases = ("encode", "prefill", "first token", "first decode")
        return {name: b - a for name, a, b in zip(phases, marks, marks[1:], strict=False)}, placed, tokens

    attach()  # compiles the encoder's kernels
    trials = [attach() for _ in range(args.trials)]
    best, placed, tokens = min(trials, key=lambda trial: trial[0]["encode"] + trial[0]["prefill"])
    to_first = best["encode"] + best["prefill"] + best["first token"]
    image_tokens = len(placed.images[0].rows)
    print(f"\n9B bench shape, {SIZE[0]}x{SIZE[1]} image: {image_tokens} image tokens in a {len(tokens)}-token prompt "
          f"(best of {args.trials})")  # fmt: skip
    for name, seconds in best.items():
        print(f"  {name:13s} {seconds * 1e3:9.1f} ms")
    print(
        f"  image to first token: {to_first * 1e3:.1f} ms; with the first decode {(to_first + best['first decode']) * 1e3:.1f} ms"
    )

    # The projection: the encode's and a long-prompt step's launches by family, scaled to the CMP's rates.
    prepared = prepare_image(Image.new("RGB", SIZE), RELEASED_9B.patch_settings, budget)
    with gpu_encoder.on_device():
        launches = gpu_encoder.prepare(prepared)
        timed = profile_launches([launch for _, launch in launches], gpu_encoder.stream)
    factors = {GEMM: rates.dp4a_per_second / CMP_DP4A_PER_SECOND, ATTENTION: fma / CMP_FMA_PER_SECOND}
    read_factor = rates.read_bandwidth / CMP_READ_BANDWIDTH
    cmp_encode = sum(seconds * factors.get(family, read_factor)
                     for (family, _), seconds in zip(launches, timed.attributed(), strict=True))  # fmt: skip
    sequence = backend.new_sequence()
    positions, rows = placed.step_inputs(0, len(tokens))
    backend.prefill_with_images(sequence, tokens, positions=positions, images=rows)
    backend.synchronize()
    stage = backend.stages[0]
    step = profile_launches(backend.prompt_step_launches(sequence), stage.stream, early_launch=stage.early_launch)
    backend.release(sequence)
    long_steps = len(tokens) // backend.prompt_rows
    step_run = PrefillRun(backend.prompt_rows, step.replay, family_times(step.names, step.attributed(), {}))
    projected = step_run.cmp_projection(rates)
    assert projected is not None
    cmp_long = long_steps * backend.prompt_rows / projected
    cmp_rest = (best["prefill"] - long_steps * step.replay + best["first token"]) * read_factor
    rows_bytes = placed.images[0].rows.nbytes
    pixel_bytes = prepared.pixel_values.shape[0] * 3 * RELEASED_9B.patch_size**2 * 4  # one frame, fp32
    cmp_link = (pixel_bytes + 2 * rows_bytes) / CMP_LINK_BYTES_PER_SECOND
    cmp_total = cmp_encode + cmp_long + cmp_rest + cmp_link
    print("\nCMP 100-210 projection (labelled, not measured): image to first token "
          f"{cmp_total * 1e3:.0f} ms")  # fmt: skip
    print(f"  encode on the GPU {cmp_encode * 1e3:.0f} ms (GEMM x {factors[GEMM]:.2f}, attention x "
          f"{factors[ATTENTION]:.2f}, the rest x {read_factor:.2f})")  # fmt: skip
    print(f"  {long_steps} long-prompt steps {cmp_long * 1e3:.0f} ms (GEMM x {factors[GEMM]:.2f}, the rest x "
          f"{read_factor:.2f}); tail steps and the selection {cmp_rest * 1e3:.0f} ms (x {read_factor:.2f})")  # fmt: skip
    print(f"  the link at {CMP_LINK_BYTES_PER_SECOND / 1e6:.0f} MB/s: pixels up, the rows down and up again "
          f"{cmp_link * 1e3:.0f} ms")  # fmt: skip
    print(f"  the first decode: {best['first decode'] * read_factor * 1e3:.0f} ms more (x {read_factor:.2f})")

    if args.json:
        args.json.write_text(json.dumps({
            "gpu": backend.gpu.name, "image_tokens": image_tokens, "prompt_tokens": len(tokens),
            "phases_seconds": best, "image_to_first_token_seconds": to_first,
            "read_bandwidth": rates.read_bandwidth, "dp4a_per_second": rates.dp4a_per_second,
            "fma_per_second": fma, "cmp_seconds": {"encode": cmp_encode, "long_prompt_steps": cmp_long,
                                                   "rest": cmp_rest, "link": cmp_link, "total": cmp_total},
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
