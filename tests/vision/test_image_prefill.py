"""Image rows through the reference backend's prompt step: in place of the embeddings, at the (t, h, w)
positions of the prompt, cut anywhere by chunks, and decoding on from the position after the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.base import ImageRows
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PixelBudget, open_image, prepare_image
from cmpchat.vision.prompt_images import EncodedImage, PromptImages
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, TEXT_F32, manifest

IMAGE_PAD = manifest()["tiny_vision_tokens"]["<|image_pad|>"]


@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(ModelFile(TEXT_F32))


def encoded(name: str) -> EncodedImage:
    projector = open_projector(MMPROJ_F32, text_width=32)
    case = manifest()["cases"][name]
    image = prepare_image(
        open_image(FIXTURES / case["image"]),
        projector.config.patch_settings,
        PixelBudget(case["min_pixels"], case["max_pixels"]),
    )
    return EncodedImage(name.encode(), image.grid, encode_image(projector, image))


def text_positions(count: int) -> np.ndarray:
    return np.repeat(np.arange(count)[:, None], 3, axis=1)


def test_image_rows_stand_in_for_the_embeddings_of_their_tokens(backend):
    tokens = [372, 117, 115, 264, 10, 76, 111, 111, 107, 58]
    padded = tokens[:3] + [IMAGE_PAD] * 4 + tokens[7:]
    rows = ImageRows(3, backend.embed(np.asarray(tokens[3:7])))
    plain = backend.prefill(backend.new_sequence(), tokens).values
    with_rows = backend.prefill_with_images(
        backend.new_sequence(), padded, positions=text_positions(len(tokens)), images=[rows]
    ).values
    np.testing.assert_allclose(with_rows, plain, rtol=0, atol=1e-6)


def test_image_rows_must_fit_the_step_and_the_model(backend):
    sequence = backend.new_sequence()
    with pytest.raises(ValueError, match="hidden size"):
        backend.prefill_with_images(
            sequence, [1, 2, 3], positions=text_positions(3), images=[ImageRows(0, np.zeros((2, 16), np.float32))]
        )
    with pytest.raises(ValueError, match="leave the step"):
        backend.prefill_with_images(
            sequence, [1, 2, 3], positions=text_positions(3), images=[ImageRows(2, np.zeros((2, 32), np.float32))]
        )


def test_a_prompt_cut_inside_an_image_reads_as_one_step_and_decodes_from_the_next_position(backend):
    images = [encoded("grow_rgba"), encoded("shrink_grey")]  # 12 tokens (3 x 4 merged), then 2 (2 x 1)
    template = [372, 117, IMAGE_PAD, 115, 264, IMAGE_PAD, 10, 76]
    tokens, placed = PromptImages.place(template, images, IMAGE_PAD, merge_size=2)
    assert len(tokens) == len(template) - 2 + 12 + 2
    assert placed.starts == (2, 16)
    assert placed.next_position == 2 + 4 + 2 + 2 + 2  # an image advances by its longer side in merged tokens

    whole = backend.new_sequence()
    positions, rows = placed.step_inputs(0, len(tokens))
    expected = backend.prefill_with_images(whole, tokens, positions=positions, images=rows).values
    assert whole.next_position == placed.next_position

    chunked = backend.new_sequence()
    for start, end in [(0, 5), (5, 17), (17, len(tokens))]:  # cuts inside both images
        positions, rows = placed.step_inputs(start, end)
        logits = backend.prefill_with_images(chunked, tokens[start:end], positions=positions, images=rows).values
    # fp32 sums in another order (chunks against one step): up to 1.24e-5 seen at logits up to 6.4
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)

    # Decoding a token reads it at the next position: as if the prompt and it were one step.
    decoded = backend.decode([chunked], [111]).values
    longer = backend.new_sequence()
    positions, rows = placed.step_inputs(0, len(tokens) + 1)
    assert positions[-1].tolist() == [placed.next_position] * 3
    once = backend.prefill_with_images(longer, [*tokens, 111], positions=positions, images=rows).values
    np.testing.assert_allclose(decoded, once, rtol=0, atol=1e-4)
