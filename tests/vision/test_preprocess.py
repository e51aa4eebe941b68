"""Preprocessing against transformers' Qwen3.5 image processor (tests/fixtures/vision, made by make_vision.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from cmpchat.errors import CmpchatError
from cmpchat.vision import preprocess
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PatchSettings, PixelBudget, image_grid, open_image, prepare_image
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, arrays, manifest

PIXEL_CASES = [name for name, case in manifest()["cases"].items() if "image" in case]
ALL_CASES = list(manifest()["cases"])


def budget_of(case: dict) -> PixelBudget:
    return PixelBudget(case["min_pixels"], case["max_pixels"])


@pytest.mark.parametrize("name", PIXEL_CASES)
def test_pixel_values_are_the_processors(name):
    case = manifest()["cases"][name]
    image = open_image(FIXTURES / case["image"])
    assert image.mode == "RGB" and (image.height, image.width) == (case["height"], case["width"])
    prepared = prepare_image(image, open_projector(MMPROJ_F32).config.patch_settings, budget_of(case))
    expected = arrays("preprocess")[f"pixel_values_{name}"]
    assert [prepared.grid.frames, prepared.grid.rows, prepared.grid.cols] == case["grid_thw"]
    assert prepared.pixel_values.dtype == np.float32 and prepared.pixel_values.shape == expected.shape
    np.testing.assert_allclose(prepared.pixel_values, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ALL_CASES)
def test_grid_and_token_count_are_the_processors(name):
    case = manifest()["cases"][name]
    grid = image_grid(case["height"], case["width"], PatchSettings(), budget_of(case))
    assert [grid.frames, grid.rows, grid.cols] == case["grid_thw"]
    assert [grid.rows * 16, grid.cols * 16] == case["resized"]
    assert grid.merged_tokens(2) == case["image_tokens"]


def test_the_default_budget_is_qwens():
    assert manifest()["cases"]["hd_720p"]["min_pixels"] == PixelBudget().min_pixels
    assert manifest()["cases"]["hd_720p"]["max_pixels"] == PixelBudget().max_pixels
    assert image_grid(720, 1280, PatchSettings(), PixelBudget()).merged_tokens(2) == 880


def test_refuses_an_image_too_narrow_for_the_encoder():
    assert image_grid(1, 200, PatchSettings(), PixelBudget()).rows == 2
    with pytest.raises(CmpchatError, match=r"image of 201x1 pixels is too narrow .* crop it"):
        image_grid(1, 201, PatchSettings(), PixelBudget())


def test_refuses_an_empty_budget():
    with pytest.raises(CmpchatError, match=r"budget 4096..1024 is not a range"):
        PixelBudget(4096, 1024)


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_decodes_bytes_and_refuses_corrupt_ones():
    assert open_image(png_bytes()).size == (40, 30)
    with pytest.raises(CmpchatError, match=r"image could not be read as an image"):
        open_image(b"this is not an image")
    with pytest.raises(CmpchatError, match=r"image could not be read as an image"):
        open_image(png_bytes()[:60])


def test_refuses_an_oversized_image_before_decoding_it(monkeypatch):
    monkeypatch.setattr(preprocess, "MAX_DECODED_PIXELS", 1199)
    with pytest.raises(CmpchatError, match=r"image is 40x30 pixels, more than the 1199 cmpchat decodes"):
        open_image(png_bytes())
