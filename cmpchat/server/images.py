"""Images in requests: every API's image part (chat's `image_url`, the Responses API's `input_image`, the Messages
API's `image` block) comes here as a URL or base64 data, and leaves as the chat layer's `ImagePart` with the
image's bytes, or as a 400 that names the part.

Accepted: `data:image/...;base64,...` URIs (and the Messages API's base64 sources); `http(s)://` URLs only when
`serve --allow-remote-images` is given, then fetched with a timeout and a size cap. Each image is encoded here
(the encoder keeps it, so building the prompt finds it encoded), so that a corrupt or oversized image is refused
with the part's name. A model without a usable projector refuses images, code `image_input_not_supported`.
"""

from __future__ import annotations

import base64
import binascii
import re
import time

import httpx

from cmpchat.api import Model
from cmpchat.chat.messages import ImagePart
from cmpchat.errors import CmpchatError
from cmpchat.server.errors import ApiError
from cmpchat.server.settings import ServerSettings

MAX_IMAGE_BYTES = 20 * 2**20
"""Largest image file accepted, in a data URI or fetched."""
FETCH_TIMEOUT_SECONDS = 10.0
"""The timeout of fetching a remote image: for connecting, for each read, and for the whole body."""

_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.ASCII)


class ImageReader:
    """Reads the images of one request for `model`, within `settings`' rules."""

    def __init__(self, model: Model, settings: ServerSettings) -> None:
        self.model = model
        self.settings = settings

    def from_url(self, url: str, where: str) -> ImagePart:
        """An image given by URL: a data URI, or an http(s) URL when the server fetches them."""
        self._check_supported(where)
        found = _DATA_URI.match(url)
        if found is not None:
            if not found["type"].lower().startswith("image/") or ";base64" not in found["params"].lower():
                raise _bad(where, "a data URI must hold a base64 image: data:image/png;base64,...")
            return self._read(url[found.end() :], where)
        if url.startswith(("http://", "https://")):
            if not self.settings.allow_remote_images:
                raise _bad(
                    where,
                    "this server does not fetch image URLs; send the image as a data URI "
                    "(data:image/png;base64,...), or start serve with --allow-remote-images",
                )
            return self._checked(_fetch(url, where), where, url)
        raise _bad(where, "an image URL must be a data URI (data:image/png;base64,...) or an http(s) URL")

    def from_base64(self, data: str, where: str) -> ImagePart:
        """An image given as base64 text (the Messages API's base64 source)."""
        self._check_supported(where)
        return self._read(data, where)

    def _check_supported(self, where: str) -> None:
        model = self.model
        if model.supports_images:
            return
        if model.projector_path is None:
            reason = "no vision projector is loaded (start serve with --mmproj FILE)"
        else:
            reason = f"the {model.backend.name} backend does not read images"
        raise ApiError(
            400, f"{where}: this server cannot read images: {reason}", param=where, code="image_input_not_supported"
        )

    def _read(self, text: str, where: str) -> ImagePart:
        if len(text) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
            raise _too_large(where)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(where, "the image is not valid base64") from None
        return self._checked(data, where, where)

    def _checked(self, data: bytes, where: str, ref: str) -> ImagePart:
        if not data:
            raise _bad(where, "the image is empty")
        if len(data) > MAX_IMAGE_BYTES:
            raise _too_large(where)
        encoder = self.model.image_encoder
        assert encoder is not None  # `_check_supported` saw one
        try:
            encoder.encode(data)
        except CmpchatError as err:
            raise _bad(where, str(err)) from None
        return ImagePart(ref, data=data)


def _fetch(url: str, where: str) -> bytes:
    """The file at `url`: within FETCH_TIMEOUT_SECONDS and MAX_IMAGE_BYTES, or a 400."""
    deadline = time.monotonic() + FETCH_TIMEOUT_SECONDS
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_SECONDS, follow_redirects=True) as response:
            if response.status_code != 200:
                raise _bad(where, f"fetching the image answered HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                raise _too_large(where)
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise _too_large(where)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the image took too long to arrive")
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:  # ValueError: a host name IDNA cannot encode
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise _bad(where, f"the image could not be fetched ({reason})") from None
    return bytes(data)


def _bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _too_large(where: str) -> ApiError:
    return _bad(where, f"the image is larger than the {MAX_IMAGE_BYTES // 2**20} MiB this server accepts")
