"""Keeping a loaded model's objects out of Python's garbage collections.

A full collection walks every tracked object while holding the GIL. Once a model is loaded, the model, its
kernels, Numba's and (in the app) Textual's objects number in the hundreds of thousands, so each full
collection took ~100 ms, and a generation thread waiting for the GIL stood still that long: several times
a reply in the app. Objects alive after a load live as long as the model, so they are frozen (left out of
every collection) until the model is replaced.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """After a model loads: free what loading left behind, then freeze everything still alive."""
    gc.collect()
    gc.freeze()


def thaw_before_replacing() -> None:
    """Before the next model loads (the old one's last reference dropped): unfreeze and collect, so the old
    model's reference cycles, GPU buffers included, are freed before the new one needs the memory."""
    gc.unfreeze()
    gc.collect()
