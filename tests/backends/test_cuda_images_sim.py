"""Image rows on the CUDA backend under Numba's CUDA simulator: a prompt holding an image (the vision fixture's
projector, encoded by the numpy reference) against the reference backend in GPU-mirroring mode, and the
long-prompt step's placement of image rows, which enter on the first stage only.

The text model is random, Q8_0, as wide as the projector's rows (32). The simulator takes about a minute a step
of one layer, so the whole-backend test is one 8-token prompt step and one decode step of a one-layer attention
model (the layer that reads the (t, h, w) positions); the long-prompt steps themselves are stubbed where they
would run (their kernels have their own tests, the GPU test runs them with images at a real shape)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from cmpchat.backends.base import Backend, ImageRows
from cmpchat.backends.gpu.buffers import images_within
from cmpchat.backends.gpu.memory_plan import StagePlan
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.chat.template import builtin_template
from cmpchat.kernels.elementwise import PLACED_ROW, embed_q8_0
from cmpchat.model.builder import build_model
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PixelBudget, open_image, prepare_image
from cmpchat.vision.prompt_images import EncodedImage, PromptImages
from tests.conftest import TINY_SHAPE, add_byte_vocabulary
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, manifest

PAGE = 128  # the smallest page that holds whole attention tiles at head size 32
WIDTH = 32  # the fixture projector's output width
IMAGE_PAD = 250  # any id: its embedding is never read


def build(tmp_path_factory: pytest.TempPathFactory, name: str, layers: int, attention_every: int) -> ModelFile:
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    shape = replace(
        TINY_SHAPE, name=name, hidden_size=WIDTH, num_layers=layers, full_attention_interval=attention_every
    )
    build_model(path, shape, add_tokenizer=add_byte_vocabulary, chat_template=builtin_template(), seed=3)
    return ModelFile(path)


def encoded(name: str) -> EncodedImage:
    """A fixture image through the numpy encoder (round_rgb: 2 x 3 merged tokens)."""
    projector = open_projector(MMPROJ_F32, text_width=WIDTH)
    case = manifest()["cases"][name]
    budget = PixelBudget(case["min_pixels"], case["max_pixels"])
    image = prepare_image(open_image(FIXTURES / case["image"]), projector.config.patch_settings, budget)
    return EncodedImage(name.encode(), image.grid, encode_image(projector, image))


def test_images_within_cuts_an_image_at_a_steps_bounds():
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    images = [ImageRows(3, rows[:4]), ImageRows(9, rows[4:])]
    first, second = images_within(images, 0, 8), images_within(images, 8, 16)
    assert [(part.start, part.rows.tolist()) for part in first] == [(3, rows[:4].tolist())]
    assert [(part.start, part.rows.tolist()) for part in second] == [(1, rows[4:].tolist())]
    assert images_within(images, 16, 20) == []


@pytest.mark.slow
def test_an_image_in_a_prompt_matches_the_mirroring_reference(tmp_path_factory):
    model_file = build(tmp_path_factory, "image-attention", layers=1, attention_every=1)
    gpu = CudaBackend(model_file, sequences=1, saved_states=0, context=512, kv_tokens=4 * PAGE, page_tokens=PAGE)
    reference = ReferenceBackend(model_file, mirror_gpu=True, page_tokens=PAGE)
    image = encoded("round_rgb")
    tokens, placed = PromptImages.place([72, IMAGE_PAD, 33], [image], IMAGE_PAD, merge_size=2)
    assert len(tokens) == 8 and placed.starts == (1,)
    positions, rows = placed.step_inputs(0, len(tokens))
    assert positions[1:7, 1].tolist() == [1, 1, 1, 2, 2, 2] and positions[1:7, 2].tolist() == [1, 2, 3] * 2
    assert positions[7].tolist() == [4, 4, 4]  # the text after an image follows its longer side

    def prompt_then_decode(backend: Backend[Any]) -> list[np.ndarray]:
        sequence = backend.new_sequence()
        prompt = backend.to_host(backend.prefill_with_images(sequence, tokens, positions=positions, images=rows))
        assert sequence.next_position == placed.next_position == 5
        return [prompt, backend.to_host(backend.decode([sequence], [111]))]  # at position 5, cache index 8

    for row, want in zip(prompt_then_decode(gpu), prompt_then_decode(reference), strict=True):
        assert np.abs(row - want).max() <= 2e-3 * np.abs(want).max()
        assert np.array_equal(row.argmax(axis=1), want.argmax(axis=1))


def test_image_rows_enter_the_first_stage_of_a_pipelined_prompt(tmp_path_factory, monkeypatch):
    """Two long-prompt chunks through two stages, the steps stubbed: the chunk that an image's first rows fall
    in and the chunk with its last rows each carry their part to the first stage, which embeds around them;
    the second stage gets its hidden states from the first, never image rows."""
    from cmpchat.backends.gpu.prompt_step import PromptBuffers
    from cmpchat.backends.gpu.stage import Stage

    model_file = build(tmp_path_factory, "image-pipeline", layers=2, attention_every=2)
    backend = CudaBackend(model_file, sequences=1, saved_states=0, context=512, kv_tokens=4 * PAGE, page_tokens=PAGE,
                          gpus=[0, 0], prompt_rows=64)  # fmt: skip
    rows = backend.prompt_rows
    uploads: list[tuple[int, list[tuple[int, int]]]] = []
    upload = PromptBuffers.upload
    stage_of = {id(stage.prompt): stage.index for stage in backend.stages}

    def recording_upload(self, tokens, positions, pages, stream, images=()):
        uploads.append((stage_of[id(self)], [(part.start, len(part.rows)) for part in images]))
        upload(self, tokens, positions, pages, stream, images)

    monkeypatch.setattr(PromptBuffers, "upload", recording_upload)
    monkeypatch.setattr(Stage, "run_prompt", lambda self, slot: None)
    image = np.random.default_rng(0).standard_normal((10, WIDTH)).astype(np.float32)
    tokens = [i % 200 for i in range(2 * rows)]
    positions = np.repeat(np.arange(2 * rows)[:, None], 3, axis=1)
    sequence = backend.new_sequence()
    backend.prefill_with_images(sequence, tokens, positions=positions, images=[ImageRows(rows - 4, image)])
    assert uploads == [(0, [(rows - 4, 4)]), (0, [(0, 6)]), (1, []), (1, [])]  # stage 1 runs chunk t - 1

    # The first stage's buffers now hold the second chunk: its image rows marked, the rows placed.
    first = backend.stages[0]
    prompt, embedding = first.prompt, first.weights.embedding
    assert prompt is not None and embedding is not None
    marked = prompt.tokens.copy_to_host()
    assert (marked[:6] == PLACED_ROW).all() and marked[6:].tolist() == tokens[rows + 6 :]
    embed_q8_0(prompt.tokens, embedding.quants, embedding.scales, prompt.hidden).run()
    hidden = prompt.hidden.copy_to_host()
    np.testing.assert_array_equal(hidden[:6], image[4:])
    reference = ReferenceBackend(model_file)
    np.testing.assert_array_equal(hidden[6:], reference.embed(np.asarray(tokens[rows + 6 :])))


def test_image_rows_that_do_not_fit_the_model_or_the_step_are_refused(tmp_path_factory):
    model_file = build(tmp_path_factory, "image-refusals", layers=1, attention_every=1)
    gpu = CudaBackend(model_file, sequences=1, saved_states=0, context=512, kv_tokens=4 * PAGE, page_tokens=PAGE)
    sequence = gpu.new_sequence()
    positions = np.zeros((3, 3), np.int64)
    with pytest.raises(ValueError, match="hidden size"):
        gpu.prefill_with_images(sequence, [1, 2, 3], positions=positions,
                                images=[ImageRows(0, np.zeros((2, 16), np.float32))])  # fmt: skip
    with pytest.raises(ValueError, match="leave the step"):
        gpu.prefill_with_images(sequence, [1, 2, 3], positions=positions,
                                images=[ImageRows(2, np.zeros((2, WIDTH), np.float32))])  # fmt: skip
    assert sequence.length == 0


def test_the_image_encoder_is_planned_on_the_first_stage_only(tmp_path_factory):
    from cmpchat.backends.gpu.device import SIMULATED_GPU
    from cmpchat.vision.gpu_encoder import RELEASED_9B, device_bytes

    model_file = build(tmp_path_factory, "image-plans", layers=2, attention_every=2)
    config = ModelConfig.from_model_file(model_file)
    encoder = device_bytes(RELEASED_9B, 2048 * 2048 // 16**2)

    def plans(encoder_bytes: int) -> list[StagePlan]:
        return CudaBackend.memory_plans(model_file, config, gpus=[SIMULATED_GPU] * 2, context=512, page_tokens=PAGE,
                                        image_encoder_bytes=encoder_bytes)  # fmt: skip

    bare, seeing = plans(0), plans(encoder)
    assert [plan.image_encoder for plan in seeing] == [encoder, 0]
    assert [plan.layers for plan in seeing] == [plan.layers for plan in bare]
    assert seeing[0].total - seeing[0].kv_pool == bare[0].total - bare[0].kv_pool + encoder
