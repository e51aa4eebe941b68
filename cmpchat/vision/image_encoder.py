"""Images to the rows that enter a prompt, each encoded once: results are kept by a hash of the image's bytes
(and the pixel budget), so a conversation's images are not encoded again every turn."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

from cmpchat.errors import CmpchatError
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.mmproj import Projector
from cmpchat.vision.preprocess import PixelBudget, open_image, prepare_image
from cmpchat.vision.prompt_images import EncodedImage

DEFAULT_CACHE_BYTES = 256 << 20
"""Encoded rows kept for reuse (a 1280x720 image at the 9B's width 4096 is 880 x 16 KiB = 14 MiB)."""


class ImageEncoder:
    """A projector and its pixel budget, with the images it encoded lately (least recently used go first once
    their rows pass `cache_bytes`)."""

    def __init__(
        self, projector: Projector, budget: PixelBudget | None = None, *, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.projector = projector
        self.budget = budget or PixelBudget()
        self.cache_bytes = cache_bytes
        self.encoded = 0
        """Images run through the encoder so far (cache misses)."""
        self._cache: OrderedDict[bytes, EncodedImage] = OrderedDict()
        self._lock = threading.Lock()
        """The server encodes a request's images on its own thread: the cache is shared by all of them."""

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
        encoded = EncodedImage(digest, prepared.grid, encode_image(self.projector, prepared))
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
