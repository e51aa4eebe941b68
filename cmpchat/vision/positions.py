"""Image tokens in the prompt and their multimodal RoPE positions, as transformers' Qwen3.5 `get_rope_index`.

A text token has the same position on all three axes (temporal, height, width). An image's merged tokens,
row by row, get temporal = the position where the image starts, height = start + row, width = start + column;
the text after it resumes at start + max(rows, columns), so positions run behind token indices by the
difference, and decoding continues from `next_position`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cmpchat.errors import CmpchatError
from cmpchat.vision.preprocess import Grid


@dataclass(frozen=True, slots=True)
class PromptPositions:
    positions: np.ndarray
    """int64 [3, tokens]: (temporal, height, width) of every prompt token."""
    next_position: int
    """The position of the first token after the prompt (on all three axes)."""

    @property
    def rope_delta(self) -> int:
        """How far positions run behind token indices after the prompt (transformers' mrope_position_deltas)."""
        return self.next_position - self.positions.shape[1]


def expand_image_pads(tokens: Sequence[int], token_counts: Sequence[int], image_pad: int) -> list[int]:
    """The chat template writes one `<|image_pad|>` per image; the model reads one per merged token."""
    pads = [i for i, token in enumerate(tokens) if token == image_pad]
    if len(pads) != len(token_counts):
        raise CmpchatError(f"the prompt has {len(pads)} image placeholders for {len(token_counts)} images")
    expanded: list[int] = []
    start = 0
    for index, count in zip(pads, token_counts):
        expanded += tokens[start:index]
        expanded += [image_pad] * count
        start = index + 1
    expanded += tokens[start:]
    return expanded


def image_positions(start: int, grid: Grid, merge_size: int) -> np.ndarray:
    """int64 [3, merged tokens] of one image whose first token is at position `start`."""
    frames, rows, cols = grid.frames, grid.rows // merge_size, grid.cols // merge_size
    temporal, height, width = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([temporal, height, width]).reshape(3, -1).astype(np.int64) + start


def prompt_positions(tokens: Sequence[int], grids: Sequence[Grid], image_pad: int, merge_size: int) -> PromptPositions:
    """Positions of a prompt whose images (in order, each a run of `image_pad` tokens) have these grids."""
    ids = np.asarray(tokens, dtype=np.int64)
    is_pad = ids == image_pad
    # Boundaries of runs of equal kind (text / image pad).
    edges = np.flatnonzero(np.diff(is_pad.astype(np.int8))) + 1
    starts = np.concatenate([[0], edges]) if ids.size else np.zeros(0, dtype=np.int64)
    ends = np.concatenate([edges, [ids.size]]) if ids.size else np.zeros(0, dtype=np.int64)
    pieces: list[np.ndarray] = []
    position = 0
    remaining = iter(grids)
    used = 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        if not is_pad[start]:
            pieces.append(np.broadcast_to(np.arange(position, position + end - start), (3, end - start)))
            position += end - start
            continue
        grid = next(remaining, None)
        used += 1
        if grid is None or grid.merged_tokens(merge_size) != end - start:
            expected = "no image" if grid is None else f"{grid.merged_tokens(merge_size)} tokens"
            raise CmpchatError(f"image {used} of the prompt has {end - start} image tokens, expected {expected}")
        pieces.append(image_positions(position, grid, merge_size))
        position += max(grid.rows, grid.cols) // merge_size
    if used != len(grids):
        raise CmpchatError(f"the prompt has image tokens for {used} images, but {len(grids)} images were given")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=np.int64)
    return PromptPositions(np.ascontiguousarray(positions, dtype=np.int64), position)
