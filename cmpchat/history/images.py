"""Attached images, stored once by content hash: `<root>/ab/<sha256>.<ext>`; history refers to the file name."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from cmpchat.errors import CmpchatError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"})
"""File types the picker offers and the store accepts."""

_EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}


@dataclass(frozen=True, slots=True)
class StoredImage:
    """An image in the store: `id` is `<sha256>.<ext>`, what history records."""

    id: str
    path: Path
    width: int
    height: int


class ImageStore:
    """A folder of images named by the hash of their bytes, so attaching the same picture twice stores it once."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, source: Path) -> StoredImage:
        """Copy the image at `source` into the store (unless already there) and describe it."""
        try:
            data = source.read_bytes()
        except OSError as err:
            raise CmpchatError(f"cannot read {source}: {err.strerror or err}") from None
        width, height, kind = _inspect(data, source)
        image_id = f"{hashlib.sha256(data).hexdigest()}.{_EXTENSIONS[kind]}"
        path = self.path(image_id)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written beside its final name and renamed, so a crash never leaves half an image under it.
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".part")
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, path)
        return StoredImage(image_id, path, width, height)

    def path(self, image_id: str) -> Path:
        if "/" in image_id or "\\" in image_id or image_id.startswith("."):
            raise CmpchatError(f"not an image id: {image_id!r}")
        return self.root / image_id[:2] / image_id

    def get(self, image_id: str) -> StoredImage | None:
        """The stored image with this id, or None when its file is gone."""
        path = self.path(image_id)
        try:
            with Image.open(path) as image:
                return StoredImage(image_id, path, image.width, image.height)
        except (OSError, UnidentifiedImageError):
            return None

    def problem(self, image_id: str, *, read: bool = True) -> str | None:
        """Why the stored image with this id cannot be sent to a model now, in a few words naming its file;
        None when it can. `read`: open and check the file's contents, not only that it is there."""
        try:
            path = self.path(image_id)
        except CmpchatError as err:
            return str(err)
        if not path.is_file():
            return f"its file is gone ({path})"
        if not read:
            return None
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError):
            return f"its file is not an image cmpchat can read ({path})"
        return None


def _inspect(data: bytes, source: Path) -> tuple[int, int, str]:
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format or ""
            width, height = image.size
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError):
        raise CmpchatError(f"{source.name} is not an image cmpchat can read (PNG, JPEG, WebP, GIF, BMP)") from None
    if kind not in _EXTENSIONS:
        raise CmpchatError(f"{source.name} is a {kind or 'unknown'} image; attach PNG, JPEG, WebP, GIF or BMP")
    return width, height, kind
