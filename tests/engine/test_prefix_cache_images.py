"""Saved states keyed by a prompt's images as well as its tokens: every image is the same run of pad ids."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from cmpchat.engine.prefix_cache import PrefixCache

# The cache only forks and releases the states it holds.
STATES = cast(Any, SimpleNamespace(fork=lambda sequence: sequence, release=lambda sequence: None))


def test_a_saved_state_is_found_only_with_the_same_images_before_its_end():
    cache = PrefixCache(STATES, capacity=4)
    prompt = [1, 9, 9, 9, 2, 3, 4]
    cache.save(prompt[:5], object(), [(1, b"cat")])
    assert cache.lookup(prompt, [(1, b"cat")]) is not None
    assert cache.lookup(prompt, [(1, b"dog")]) is None
    assert cache.lookup(prompt) is None
    # An image that starts at or after the saved end is not part of the saved state.
    cache.save(prompt[:1], object(), [(1, b"cat")])
    hit = cache.lookup(prompt[:4], [(1, b"dog")])
    assert hit is not None and hit.length == 1
