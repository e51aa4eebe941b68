"""Saved sequence states keyed by the exact token prefix they consumed, so a prompt that extends one
skips that part of its prefill.

A Gated DeltaNet layer folds every token into one recurrent state, which cannot be rewound: a state is
only reusable at the position where it was saved. So the engine saves states at chosen positions (where the
next turn of a conversation will stop matching this one, a long prompt's last chunk boundary, a finished
reply's end) and a new prompt resumes from the longest saved prefix it starts with. A saved state shares its
KV pages with the sequence it was saved from (`Backend.fork`), so what it costs is one recurrent state and the
pages only it still holds. Entries are evicted least recently used first: by count, or when the engine needs
their sequences or pages back.

A prompt's images are part of its key (`ImageMarks`: where each image starts, and its digest): every image
is the same run of `<|image_pad|>` ids, so two prompts with different pictures must not share a state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend

ImageMarks = Sequence[tuple[int, bytes]]
"""(index of an image's first token, the image's digest) for each image of a prompt, in order."""


@dataclass(slots=True)
class _Entry:
    tokens: np.ndarray
    images: list[tuple[int, bytes]]
    sequence: Any


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A fresh copy of a saved state that has consumed the prompt's first `length` tokens."""

    length: int
    sequence: Any


class PrefixCache:
    """At most `capacity` saved states (0 disables the cache); owns their sequences and releases evicted ones."""

    def __init__(self, backend: Backend[Any], capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._backend = backend
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, bytes], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], images: ImageMarks = ()) -> PrefixHit | None:
        """The longest saved prefix shorter than `prompt` (at least one token must remain to prefill)."""
        lengths = sorted({length for length, _ in self._entries if length < len(prompt)})
        if not lengths:
            return None
        tokens = _as_array(prompt)
        digests = _prefix_digests(tokens, lengths, images)
        for length in reversed(lengths):
            key = (length, digests[length])
            entry = self._entries.get(key)
            if (
                entry is not None
                and np.array_equal(entry.tokens, tokens[:length])
                and entry.images == _marks_within(images, length)
            ):
                self._entries.move_to_end(key)
                return PrefixHit(length, self._backend.fork(entry.sequence))
        return None

    def contains(self, prefix: Sequence[int], images: ImageMarks = ()) -> bool:
        return _key(prefix, images) in self._entries

    def _touch(self, prefix: Sequence[int], images: ImageMarks) -> bool:
        """Mark the entry of exactly `prefix` as just used; False when there is none."""
        key = _key(prefix, images)
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def save(self, prefix: Sequence[int], sequence: Any, images: ImageMarks = ()) -> None:
        """Keep a fork of `sequence`, which has read exactly `prefix` (an entry already there counts as used);
        `images` are the prompt's (those starting past the prefix are left out)."""
        if self.capacity == 0 or not prefix or self._touch(prefix, images):
            return
        self._store(prefix, images, self._backend.fork(sequence))

    def keep(self, prefix: Sequence[int], sequence: Any, images: ImageMarks = ()) -> None:
        """Take `sequence` itself, which has read exactly `prefix` and is not used otherwise any more."""
        if self.capacity == 0 or not prefix or self._touch(prefix, images):
            self._backend.release(sequence)
            return
        self._store(prefix, images, sequence)

    def evict_oldest(self) -> bool:
        """Release the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        _, evicted = self._entries.popitem(last=False)
        self._backend.release(evicted.sequence)
        return True

    def clear(self) -> None:
        while self.evict_oldest():
            pass

    def _store(self, prefix: Sequence[int], images: ImageMarks, sequence: Any) -> None:
        entry = _Entry(_as_array(prefix).copy(), _marks_within(images, len(prefix)), sequence)
        self._entries[_key(prefix, images)] = entry
        while len(self._entries) > self.capacity:
            self.evict_oldest()


def _key(prefix: Sequence[int], images: ImageMarks) -> tuple[int, bytes]:
    tokens = _as_array(prefix)
    return len(tokens), _prefix_digests(tokens, [len(tokens)], images)[len(tokens)]


def _marks_within(images: ImageMarks, length: int) -> list[tuple[int, bytes]]:
    return [(start, digest) for start, digest in images if start < length]


def _as_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def _prefix_digests(tokens: np.ndarray, lengths: Sequence[int], images: ImageMarks) -> dict[int, bytes]:
    """A digest of `tokens[:n]` and the images starting before n, for each n in ascending `lengths`, in one pass
    over the tokens: an image's digest goes in just before its first token."""
    data = tokens.astype("<i8", copy=False).tobytes()
    hasher = hashlib.blake2b(digest_size=16)
    digests: dict[int, bytes] = {}
    pending = iter(sorted(images))
    image = next(pending, None)
    done = 0
    for length in lengths:
        while image is not None and image[0] < length:
            hasher.update(data[done * 8 : image[0] * 8])
            hasher.update(image[1])
            done = image[0]
            image = next(pending, None)
        hasher.update(data[done * 8 : length * 8])
        digests[length] = hasher.copy().digest()
        done = length
    return digests
