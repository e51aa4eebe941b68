"""Image tokens and M-RoPE positions against transformers' Qwen3_5Model.get_rope_index (tests/fixtures/vision)."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.errors import CmpchatError
from cmpchat.vision.positions import expand_image_pads, image_positions, prompt_positions
from cmpchat.vision.preprocess import Grid
from tests.vision.vision_fixtures import arrays, manifest

TOKENS = manifest()["tokens"]
PAD = TOKENS["image_pad"]


def template_prompt(parts: list) -> tuple[list[int], list[Grid]]:
    """The prompt as the chat template writes it (one pad per image), and the images' grids."""
    ids: list[int] = []
    grids = []
    for part in parts:
        if isinstance(part, int):
            ids += [TOKENS["text"]] * part
        else:
            grids.append(Grid(*manifest()["cases"][part]["grid_thw"]))
            ids += [TOKENS["vision_start"], PAD, TOKENS["vision_end"]]
    return ids, grids


@pytest.mark.parametrize("name", list(manifest()["position_cases"]))
def test_positions_are_get_rope_indexs(name):
    ids, grids = template_prompt(manifest()["position_cases"][name])
    expanded = expand_image_pads(ids, [grid.merged_tokens(2) for grid in grids], PAD)
    expected = arrays("positions")
    np.testing.assert_array_equal(expanded, expected[f"input_ids_{name}"])
    found = prompt_positions(expanded, grids, PAD, merge_size=2)
    np.testing.assert_array_equal(found.positions, expected[f"position_ids_{name}"])
    assert found.rope_delta == int(expected[f"rope_delta_{name}"])


def test_an_image_is_laid_out_row_by_row_from_its_start():
    positions = image_positions(5, Grid(1, 4, 6), merge_size=2)
    assert positions.shape == (3, 6)
    np.testing.assert_array_equal(positions[0], [5] * 6)
    np.testing.assert_array_equal(positions[1], [5, 5, 5, 6, 6, 6])
    np.testing.assert_array_equal(positions[2], [5, 6, 7, 5, 6, 7])


def test_refuses_images_that_do_not_fit_the_prompt():
    with pytest.raises(CmpchatError, match=r"1 image placeholders for 2 images"):
        expand_image_pads([1, PAD, 2], [4, 4], PAD)
    with pytest.raises(CmpchatError, match=r"image 1 of the prompt has 3 image tokens, expected 6 tokens"):
        prompt_positions([1, PAD, PAD, PAD, 2], [Grid(1, 4, 6)], PAD, merge_size=2)
    with pytest.raises(CmpchatError, match=r"image tokens for 1 images, but 2 images were given"):
        prompt_positions([1, PAD, PAD, 2], [Grid(1, 2, 4), Grid(1, 2, 4)], PAD, merge_size=2)
