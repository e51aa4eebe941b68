"""Image rows on the CUDA backend on a real GPU: the oracle model with the released head sizes (and M-RoPE
sections), as wide as the vision fixture's projector (32), reading a prompt whose image straddles the end of a
long-prompt step, against the reference backend in GPU-mirroring mode (within `MIRROR_TOLERANCE`); two
pipeline stages against one, bit for bit (the rows enter the first stage only); and `open_model` on cuda
encoding on the GPU with the encoder reserved in the first stage's plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import cmpchat
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.prompt_step import PIPELINE_PROMPT_ROWS, PROMPT_ROWS
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.gpu_encoder import device_bytes
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PixelBudget, prepare_image
from cmpchat.vision.prompt_images import EncodedImage, PromptImages
from tests.vision.vision_fixtures import MMPROJ_F32

pytestmark = pytest.mark.gpu

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle" / "real_heads.q8_0.gguf"
MIRROR_TOLERANCE = 2e-2
"""Of the logits' range. This random model turns a quant on the other side of a rounding tie into logits up to 7e-3
apart: on the reference itself, image rows perturbed by 1e-6 of their size moved the prompt's logits by up to 6.9e-3
and the decode step's by 5.3e-3 (CPU, 2026-12-03), and the H200 measured 1.3e-5 and 7.2e-3. A misplaced image
is far outside: its rows one token late move them by 9.8e-2 and 5.6e-2, reversed by 1.3e-1 and 9.4e-2."""
BUDGET = PixelBudget(65_536, 131_072)
"""Holds a 384 x 320 picture as it is: 12 x 10 merged tokens."""


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (320, 384, 3), dtype=np.uint8))


def image_prompt(vocab: int) -> tuple[list[int], PromptImages]:
    """200 text tokens, a 120-token image (tokens 200 .. 320: cut by the first long-prompt step's end), 10
    more; the numpy encoder's rows.

    Text alone on this model differs from the mirroring reference by as much (H200, 2026-12-03: 8.8e-3 at 272
    tokens, 7.2e-3 at 300, 2.1e-3 and 1.7e-5 at 420 by the draw): see `MIRROR_TOLERANCE`."""
    projector = open_projector(MMPROJ_F32, text_width=32)
    prepared = prepare_image(picture(0), projector.config.patch_settings, BUDGET)
    image = EncodedImage(b"picture", prepared.grid, encode_image(projector, prepared))
    pad = vocab - 1
    text = np.random.default_rng(1).integers(0, pad, 210).tolist()
    tokens, placed = PromptImages.place([*text[:200], pad, *text[200:]], [image], pad, merge_size=2)
    assert len(tokens) == 330 and placed.starts == (200,) and 200 < PROMPT_ROWS < 320
    return tokens, placed


def prompt_then_decode(backend, tokens: list[int], placed: PromptImages) -> list[np.ndarray]:
    """The prompt's logits, then a decode step's after a token, the sequence's next position checked."""
    sequence = backend.new_sequence()
    positions, rows = placed.step_inputs(0, len(tokens))
    out = [backend.to_host(backend.prefill_with_images(sequence, tokens, positions=positions, images=rows))]
    assert sequence.next_position == placed.next_position
    out.append(backend.to_host(backend.decode([sequence], [tokens[0]])))
    backend.release(sequence)
    return out


def test_an_image_across_a_long_prompt_step_and_its_tail_matches_the_mirroring_reference():
    model_file = ModelFile(ORACLE)
    gpu = CudaBackend(model_file, context=4096)
    assert gpu.stages[0].prompt is not None
    tokens, placed = image_prompt(gpu.config.vocab_size)
    got = prompt_then_decode(gpu, tokens, placed)
    expected = prompt_then_decode(ReferenceBackend(model_file, mirror_gpu=True), tokens, placed)
    for row, want in zip(got, expected, strict=True):
        error = np.abs(row - want).max() / np.abs(want).max()
        print(f"image prompt vs the mirroring reference: {error:.2e}")
        assert error <= MIRROR_TOLERANCE


def test_two_stages_read_an_image_as_one_stage_does_bit_for_bit():
    model_file = ModelFile(ORACLE)
    one = CudaBackend(model_file, context=4096, prompt_rows=PIPELINE_PROMPT_ROWS)
    two = CudaBackend(model_file, context=4096, gpus=[0, 0])
    tokens, placed = image_prompt(one.config.vocab_size)
    for a, b in zip(prompt_then_decode(one, tokens, placed), prompt_then_decode(two, tokens, placed), strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_open_model_on_cuda_encodes_on_the_gpu_within_its_plan(tmp_path):
    path = tmp_path / "picture.png"
    picture(2).save(path)
    model = cmpchat.open_model(ORACLE, backend="cuda", mmproj=MMPROJ_F32, image_budget=BUDGET)
    assert model.supports_images and model.image_encoder is not None
    projector = model.image_encoder.projector
    assert isinstance(model.backend, CudaBackend)
    assert model.backend.plans[0].image_encoder == device_bytes(projector.config, BUDGET.max_pixels // 16**2)
    assert any(line.strip().startswith("image encoder") for line in model.backend.describe())
    # The GPU's rows against the numpy encoder's: the int8 path's error (tests/vision/test_gpu_encoder_sim.py).
    rows = model.image_encoder.encode(path).rows
    reference = encode_image(projector, prepare_image(picture(2), projector.config.patch_settings, BUDGET))
    assert rows.shape == reference.shape == (120, 32)
    assert np.sqrt(((rows - reference) ** 2).mean() / (reference**2).mean()) < 0.04
