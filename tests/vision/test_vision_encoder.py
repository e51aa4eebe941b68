"""The numpy encoder against transformers' Qwen3.5 vision tower, read from llama.cpp's mmproj of it
(tests/fixtures/vision: a random tower of width 64, 2 blocks, a 4x4 position table)."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.vision.encoder import encode_image, merge_patches, patch_states
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PixelBudget, open_image, prepare_image
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F16, MMPROJ_F32, arrays, manifest

# Ours differ from transformers' fp32 forward by < 4e-6 on values up to ~6. The bound is tight enough that
# the merger's GELU in its tanh form instead of erf (3.5e-4 off) fails it; a half-pixel instead of a
# corner-aligned position resample, row and column angles swapped, raster patch order or another rope
# base are off by 0.07 to 1.2.
TOLERANCE = 5e-5


def prepared(name: str, projector):
    case = manifest()["cases"][name]
    image = open_image(FIXTURES / case["image"])
    return prepare_image(image, projector.config.patch_settings, PixelBudget(case["min_pixels"], case["max_pixels"]))


@pytest.mark.parametrize("name", manifest()["encoder_cases"])
def test_patch_states_and_merged_tokens_are_transformers(name):
    projector = open_projector(MMPROJ_F32, text_width=32)
    image = prepared(name, projector)
    states = patch_states(projector, image)
    np.testing.assert_allclose(states, arrays("encoder")[f"patch_states_{name}"], rtol=0, atol=TOLERANCE)
    merged = merge_patches(projector, states)
    expected = arrays("encoder")[f"merged_{name}"]
    assert merged.dtype == np.float32 and merged.shape == (image.grid.merged_tokens(2), 32) == expected.shape
    np.testing.assert_allclose(merged, expected, rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(encode_image(projector, image), merged)


def test_the_f16_projector_stays_near_the_f32_oracle():
    projector = open_projector(MMPROJ_F16)
    for name in manifest()["encoder_cases"]:
        expected = arrays("encoder")[f"merged_{name}"]
        difference = np.abs(encode_image(projector, prepared(name, projector)) - expected).max()
        assert 0 < difference < 5e-3, name
