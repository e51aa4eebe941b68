"""A prompt's images as the engine carries them: each image's run of `<|image_pad|>` tokens, its encoded rows,
and the (t, h, w) position of every prompt token (`positions.prompt_positions`).

A prompt step over tokens `start .. end` takes the positions of those tokens and the rows of the images (or the
runs of them) that fall inside (`step_inputs`), so a chunk boundary may cut an image. Tokens past the prompt (a
preempted reply's, read again) are text and follow on from `next_position`. Saved states are keyed by the
images too (`marks`): every image is the same run of pad ids, so token ids alone would let two prompts with
different pictures share a state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cmpchat.backends.base import ImageRows
from cmpchat.vision.positions import expand_image_pads, prompt_positions
from cmpchat.vision.preprocess import Grid


@dataclass(frozen=True, slots=True, eq=False)
class EncodedImage:
    """One image through the encoder."""

    digest: bytes
    """Identifies the rows: a hash of the image's bytes and the pixel budget it was resized within."""
    grid: Grid
    rows: np.ndarray
    """float32 [merged tokens, text width]."""


@dataclass(frozen=True, slots=True, eq=False)
class PromptImages:
    starts: tuple[int, ...]
    """Index of each image's first token in the prompt."""
    images: tuple[EncodedImage, ...]
    positions: np.ndarray
    """int64 [prompt tokens, 3]."""
    next_position: int

    @classmethod
    def place(
        cls, tokens: Sequence[int], images: Sequence[EncodedImage], image_pad: int, merge_size: int
    ) -> tuple[list[int], PromptImages]:
        """Expand the template's one `image_pad` per image to the image's tokens; the tokens and their images."""
        expanded = expand_image_pads(tokens, [len(image.rows) for image in images], image_pad)
        placed = prompt_positions(expanded, [image.grid for image in images], image_pad, merge_size)
        is_pad = np.asarray(expanded, dtype=np.int64) == image_pad
        run_starts = np.flatnonzero(is_pad & ~np.concatenate([[False], is_pad[:-1]]))
        return expanded, cls(
            tuple(int(start) for start in run_starts),
            tuple(images),
            np.ascontiguousarray(placed.positions.T),
            placed.next_position,
        )

    def step_inputs(self, start: int, end: int) -> tuple[np.ndarray, list[ImageRows]]:
        """Positions [end - start, 3] of tokens `start .. end` and the image rows among them."""
        prompt = len(self.positions)
        beyond = self.next_position + np.arange(max(start, prompt), max(end, prompt)) - prompt
        positions = np.concatenate([self.positions[start:end], np.repeat(beyond[:, None], 3, axis=1)])
        rows = []
        for first, image in zip(self.starts, self.images):
            lo, hi = max(first, start), min(first + len(image.rows), end)
            if lo < hi:
                rows.append(ImageRows(lo - start, image.rows[lo - first : hi - first]))
        return positions, rows

    def marks(self) -> list[tuple[int, bytes]]:
        """(first token, digest) of each image, in prompt order: what a saved state's key adds to its tokens."""
        return [(first, image.digest) for first, image in zip(self.starts, self.images)]
