"""Images to encoder input, as Qwen's image processor does it (transformers' Qwen2-VL processor with Qwen3.5's
settings, PIL backend).

Steps: decode and flatten to RGB (transparency over white), resize with PIL's bicubic filter to the nearest
sides that are multiples of patch x merge (32 px) and whose area lies in the pixel budget, keeping the aspect
ratio; scale to [0, 1] and normalise with the projector's mean and std; cut into 16-px patches, each repeated
for the two frames of the temporal pair, ordered so that every 2x2 group of patches that the merger joins is
contiguous.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from cmpchat.errors import CmpchatError

# The budget of Qwen3.5's released preprocessor config: 64 .. 16384 merged tokens of 32 x 32 px.
DEFAULT_MIN_PIXELS = 65_536
DEFAULT_MAX_PIXELS = 16_777_216
# Beyond this aspect ratio Qwen's resize rule refuses the image (one side would be under a patch).
MAX_ASPECT_RATIO = 200
# Decoding bigger images is refused before they are read (PIL's own bomb limit is a warning up to 2x this).
MAX_DECODED_PIXELS = 178_956_970


@dataclass(frozen=True, slots=True)
class PixelBudget:
    """The area an image is resized into, in pixels of the resized image."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise CmpchatError(
                f"image pixel budget {self.min_pixels}..{self.max_pixels} is not a range of positive sizes"
            )


@dataclass(frozen=True, slots=True)
class Grid:
    """An image's patch grid: temporal frames (1 for a still image), rows and columns of 16-px patches."""

    frames: int
    rows: int
    cols: int

    def merged_tokens(self, merge_size: int) -> int:
        """How many `<|image_pad|>` tokens the image takes in the prompt."""
        return self.frames * (self.rows // merge_size) * (self.cols // merge_size)


@dataclass(frozen=True, slots=True)
class PatchSettings:
    """What preprocessing needs from the projector."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)


@dataclass(frozen=True, slots=True)
class PreparedImage:
    pixel_values: np.ndarray
    """float32 [patches, 3 * temporal * patch * patch]: one row per patch, in merge-group order."""
    grid: Grid


def resized_size(height: int, width: int, factor: int, budget: PixelBudget) -> tuple[int, int]:
    """(height, width) after Qwen's resize: multiples of `factor`, area within the budget, aspect kept."""
    if min(height, width) <= 0:
        raise CmpchatError(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise CmpchatError(
            f"image of {width}x{height} pixels is too narrow for the vision encoder "
            f"(aspect ratio over {MAX_ASPECT_RATIO}:1); crop it"
        )
    # Python's round (half to even) as in the processor: 22.5 rows of 32 px become 22.
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > budget.max_pixels:
        shrink = math.sqrt(height * width / budget.max_pixels)
        new_height = max(factor, math.floor(height / shrink / factor) * factor)
        new_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_height * new_width < budget.min_pixels:
        grow = math.sqrt(budget.min_pixels / (height * width))
        new_height = math.ceil(height * grow / factor) * factor
        new_width = math.ceil(width * grow / factor) * factor
    return new_height, new_width


def image_grid(height: int, width: int, settings: PatchSettings, budget: PixelBudget) -> Grid:
    """The patch grid of an image of this size, without decoding it."""
    factor = settings.patch_size * settings.merge_size
    new_height, new_width = resized_size(height, width, factor, budget)
    return Grid(1, new_height // settings.patch_size, new_width // settings.patch_size)


def open_image(source: bytes | str | Path) -> Image.Image:
    """Decode an image file or its bytes, flattened to RGB; a corrupt or oversized file is one clear line."""
    name = "image" if isinstance(source, bytes) else Path(source).name
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        if image.width * image.height > MAX_DECODED_PIXELS:
            raise CmpchatError(
                f"{name} is {image.width}x{image.height} pixels, more than the {MAX_DECODED_PIXELS} cmpchat decodes"
            )
        image.load()
    except UnidentifiedImageError as err:  # its message names Python's file object, not the image
        raise CmpchatError(f"{name} could not be read as an image (not a format Pillow knows)") from err
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise CmpchatError(f"{name} could not be read as an image ({err})") from err
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white as the processor does."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def prepare_image(image: Image.Image, settings: PatchSettings, budget: PixelBudget) -> PreparedImage:
    """Resize, normalise and cut an image into the encoder's patch rows."""
    image = to_rgb(image)
    grid = image_grid(image.height, image.width, settings, budget)
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch
    resized = image.resize((grid.cols * p, grid.rows * p), Image.Resampling.BICUBIC)
    # Scaled in float64 then stored as float32, then normalised in float32, as the processor does.
    scaled = (np.asarray(resized, dtype=np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(settings.image_mean, dtype=np.float32)
    std = np.asarray(settings.image_std, dtype=np.float32)
    normalised = ((scaled - mean) / std).transpose(2, 0, 1)  # [channel, height, width]
    # [c, rows/m, m, p, cols/m, m, p] -> [rows/m, cols/m, m, m, c, p, p]: merge groups contiguous.
    blocks = normalised.reshape(3, grid.rows // m, m, p, grid.cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    pixel_values = np.ascontiguousarray(frames.reshape(grid.rows * grid.cols, 3 * t * p * p), dtype=np.float32)
    return PreparedImage(pixel_values, grid)
