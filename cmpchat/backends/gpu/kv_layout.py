"""How KV-cache pages are laid out on a GPU: what a token costs and what the writing and reading kernels take.

The pool's bookkeeping (`backends.kv_pool`) hands out page numbers; a layout turns them into device memory. A
step and a memory plan only talk to the layout, so a compressed format plugs in as another layout with its own
kernels. fp16 is the first one: per attention layer keys and values [pages, page_tokens, Hkv, hd], which is what
`qk_norm_rope` writes and decode and prefill attention read (`kernels/attention.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.gpu.buffers import fill_zero
from cmpchat.backends.kv_pool import PageCopy
from cmpchat.model.config import ModelConfig


class KvLayout(ABC):
    """A page format: its size, and how to make pages in it."""

    name: str

    @abstractmethod
    def bytes_per_token(self, config: ModelConfig, layers: Sequence[int]) -> int:
        """KV bytes one context token takes over the attention `layers`."""

    @abstractmethod
    def allocate(self, config: ModelConfig, layers: Sequence[int], pages: int, page_tokens: int) -> KvPages:
        """`pages` pages of `page_tokens` tokens for each of the attention `layers`, on the current device."""


class KvPages(ABC):
    """One stage's KV pages in one layout."""

    page_tokens: int

    @abstractmethod
    def caches(self, layer: int) -> tuple[Any, ...]:
        """What the kernels that write and read attention layer `layer`'s cache take."""

    @abstractmethod
    def copy(self, copies: Sequence[PageCopy], stream: Any) -> None:
        """Queue the copy-on-write copies of partial pages (every layer), in order."""

    @abstractmethod
    def zero(self, pages: Sequence[int], stream: Any) -> None:
        """Queue zeroing these pages in every layer (benchmarks fill a context without running it)."""


class Fp16Layout(KvLayout):
    name = "f16"

    def bytes_per_token(self, config: ModelConfig, layers: Sequence[int]) -> int:
        return len(layers) * 2 * config.num_kv_heads * config.head_dim * 2

    def allocate(self, config: ModelConfig, layers: Sequence[int], pages: int, page_tokens: int) -> Fp16Pages:
        shape = (pages, page_tokens, config.num_kv_heads, config.head_dim)
        keys = {layer: cuda.device_array(shape, np.float16) for layer in layers}
        values = {layer: cuda.device_array(shape, np.float16) for layer in layers}
        return Fp16Pages(page_tokens, keys, values)


@dataclass
class Fp16Pages(KvPages):
    page_tokens: int
    keys: dict[int, Any]
    """attention layer -> fp16 [pages, page_tokens, Hkv, hd]"""
    values: dict[int, Any]

    def caches(self, layer: int) -> tuple[Any, Any]:
        return self.keys[layer], self.values[layer]

    def copy(self, copies: Sequence[PageCopy], stream: Any) -> None:
        for copy in copies:
            for caches in (self.keys, self.values):
                for array in caches.values():
                    array[copy.target, : copy.tokens].copy_to_device(array[copy.source, : copy.tokens], stream=stream)

    def zero(self, pages: Sequence[int], stream: Any) -> None:
        for caches in (self.keys, self.values):
            for array in caches.values():
                for page in pages:
                    fill_zero(array[page], stream)


FP16 = Fp16Layout()
LAYOUTS: dict[str, KvLayout] = {layout.name: layout for layout in (FP16,)}
