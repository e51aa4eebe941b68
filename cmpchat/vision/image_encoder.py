"""Images to the rows that enter a prompt, each encoded once: results are kept by a hash of the image's bytes
(and the pixel budget), so a conversation's images are not encoded again every turn.

The encoder is the numpy reference (`encoder.encode_image`) unless another is given: `ImageEncoder.on_gpu`
runs it on a GPU (`gpu_encoder.GpuImageEncoder`, the projector's weights uploaded once)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from cmpchat.errors import CmpchatError
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.mmproj import Projector
from cmpchat.vision.preprocess import PixelBudget, PreparedImage, open_image, prepare_image
from cmpchat.vision.prompt_images import EncodedImage

EncodeFunction = Callable[[PreparedImage], np.ndarray]
"""A prepared image to its float32 rows [merged tokens, text width]."""

DEFAULT_CACHE_BYTES = 256 << 20
"""Encoded rows kept for reuse (a 1280x720 image at the 9B's width 4096 is 880 x 16 KiB = 14 MiB)."""


class ImageEncoder:
    """A projector and its pixel budget, with the images it encoded lately (least recently used go first once
    their rows pass `cache_bytes`)."""

    def __init__(
        self,
        projector: Projector,
        budget: PixelBudget | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        encode: EncodeFunction | None = None,
    ) -> None:
        self.projector = projector
        self._encode: EncodeFunction = encode or partial(encode_image, projector)
        """What computes the rows: the numpy reference unless given (`on_gpu`)."""
        self.budget = budget or PixelBudget()
        self.cache_bytes = cache_bytes
        self.encoded = 0
        """Images run through the encoder so far (cache misses)."""
        self._cache: OrderedDict[bytes, EncodedImage] = OrderedDict()
        self._lock = threading.Lock()
        """The server encodes a request's images on its own thread: the cache is shared by all of them."""

    @classmethod
    def on_gpu(
        cls,
        projector: Projector,
        budget: PixelBudget | None = None,
        *,
        gpu_index: int = 0,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> ImageEncoder:
        """Images encoded on GPU `gpu_index` (the projector's weights are uploaded now, as Q8_0)."""
        from cmpchat.vision.gpu_encoder import GpuImageEncoder

        gpu = GpuImageEncoder(projector, gpu_index=gpu_index)
        return cls(projector, budget, cache_bytes=cache_bytes, encode=gpu.encode)

    def encode(self, source: bytes | str | Path) -> EncodedImage:
        """An image file or its bytes as prompt rows; a missing, corrupt or oversized image is one clear line."""
        data = source if isinstance(source, bytes) else _read(Path(source))
        digest = hashlib.sha256(data + f"|{self.budget.min_pixels}|{self.budget.max_pixels}".encode()).digest()
        with self._lock:
            found = self._cache.get(digest)
            if found is not None:
                self._cache.move_to_end(digest)
                return found
        image = open_image(data if isinstance(source, bytes) else Path(source))
        prepared = prepare_image(image, self.projector.config.patch_settings, self.budget)
        encoded = EncodedImage(digest, prepared.grid, self._encode(prepared))
        with self._lock:
            self.encoded += 1
            self._cache[digest] = encoded
            while sum(item.rows.nbytes for item in self._cache.values()) > self.cache_bytes and len(self._cache) > 1:
                self._cache.popitem(last=False)
        return encoded


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CmpchatError(f"image {path} could not be read ({err.strerror or err})") from err
