"""Saved sequence states keyed by the exact token prefix they consumed, so a prompt that extends one
skips that part of its prefill.

A Gated DeltaNet layer folds every token into one recurrent state, which cannot be rewound: a state is
only reusable at the position where it was saved. So the engine saves states at chosen positions (where the
next turn of a conversation will stop matching this one, a long prompt's last chunk boundary, a finished
reply's end) and a new prompt resumes from the longest saved prefix it starts with. A saved state shares its
KV pages with the sequence it was saved from (`Backend.fork`), so what it costs is one recurrent state and the
pages only it still holds. Entries are evicted least recently used first: by count, or when the engine needs
their sequences or pages back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend


@dataclass(slots=True)
class _Entry:
    tokens: np.ndarray
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

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest saved prefix shorter than `prompt` (at least one token must remain to prefill)."""
        lengths = sorted({length for length, _ in self._entries if length < len(prompt)})
        if not lengths:
            return None
        tokens = _as_array(prompt)
        digests = _prefix_digests(tokens, lengths)
        for length in reversed(lengths):
            key = (length, digests[length])
            entry = self._entries.get(key)
            if entry is not None and np.array_equal(entry.tokens, tokens[:length]):
                self._entries.move_to_end(key)
                return PrefixHit(length, self._backend.fork(entry.sequence))
        return None

    def contains(self, prefix: Sequence[int]) -> bool:
        return _key(prefix) in self._entries

    def _touch(self, prefix: Sequence[int]) -> bool:
        """Mark the entry of exactly `prefix` as just used; False when there is none."""
        key = _key(prefix)
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def save(self, prefix: Sequence[int], sequence: Any) -> None:
        """Keep a fork of `sequence`, which has read exactly `prefix` (an entry already there counts as used)."""
        if self.capacity == 0 or not prefix or self._touch(prefix):
            return
        self._store(prefix, self._backend.fork(sequence))

    def keep(self, prefix: Sequence[int], sequence: Any) -> None:
        """Take `sequence` itself, which has read exactly `prefix` and is not used otherwise any more."""
        if self.capacity == 0 or not prefix or self._touch(prefix):
            self._backend.release(sequence)
            return
        self._store(prefix, sequence)

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

    def _store(self, prefix: Sequence[int], sequence: Any) -> None:
        self._entries[_key(prefix)] = _Entry(_as_array(prefix).copy(), sequence)
        while len(self._entries) > self.capacity:
            self.evict_oldest()


def _key(prefix: Sequence[int]) -> tuple[int, bytes]:
    tokens = _as_array(prefix)
    return len(tokens), _prefix_digests(tokens, [len(tokens)])[len(tokens)]


def _as_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def _prefix_digests(tokens: np.ndarray, lengths: Sequence[int]) -> dict[int, bytes]:
    """A digest of `tokens[:n]` for each n in ascending `lengths`, in one pass over the tokens."""
    data = tokens.astype("<i8", copy=False).tobytes()
    hasher = hashlib.blake2b(digest_size=16)
    digests: dict[int, bytes] = {}
    done = 0
    for length in lengths:
        hasher.update(data[done * 8 : length * 8])
        digests[length] = hasher.copy().digest()
        done = length
    return digests
