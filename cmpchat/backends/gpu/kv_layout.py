"""How KV-cache pages are laid out on a GPU: what a token costs and what the writing and reading kernels take.

The pool's bookkeeping (`backends.kv_pool`) hands out page numbers; a layout turns them into device memory. A
step and a memory plan only talk to the layout, so a compressed format plugs in as another layout with its own
kernels. fp16: per attention layer keys and values [pages, page_tokens, Hkv, hd], which is what `qk_norm_rope`
writes and decode and prefill attention read (`kernels/attention.py`). The compressed formats of
`kernels/kv_codes.GPU_FORMATS` (q8, tq3, q8k-tq3v): per attention layer the four arrays `kv_codes` describes,
which `kv_write` writes and `attention_compressed` and `compressed_prefill_attention` read.
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
from cmpchat.errors import CmpchatError
from cmpchat.kernels.kv_codes import GPU_FORMATS
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

    format_name: str
    """The layout's name: which kernels write and read the caches."""
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


def _copy_pages(arrays: Sequence[Any], copies: Sequence[PageCopy], stream: Any) -> None:
    for copy in copies:
        for array in arrays:
            array[copy.target, : copy.tokens].copy_to_device(array[copy.source, : copy.tokens], stream=stream)


def _zero_pages(arrays: Sequence[Any], pages: Sequence[int], stream: Any) -> None:
    for array in arrays:
        for page in pages:
            fill_zero(array[page], stream)


@dataclass
class Fp16Pages(KvPages):
    format_name = "f16"
    page_tokens: int
    keys: dict[int, Any]
    """attention layer -> fp16 [pages, page_tokens, Hkv, hd]"""
    values: dict[int, Any]

    def caches(self, layer: int) -> tuple[Any, Any]:
        return self.keys[layer], self.values[layer]

    def copy(self, copies: Sequence[PageCopy], stream: Any) -> None:
        _copy_pages([*self.keys.values(), *self.values.values()], copies, stream)

    def zero(self, pages: Sequence[int], stream: Any) -> None:
        _zero_pages([*self.keys.values(), *self.values.values()], pages, stream)


class CompressedLayout(KvLayout):
    """A format of `kv_codes.GPU_FORMATS`: codes and scales of keys and values."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.codecs = GPU_FORMATS[name]

    def bytes_per_token(self, config: ModelConfig, layers: Sequence[int]) -> int:
        for codec in self.codecs:  # the memory plan asks first, before anything is allocated
            try:
                codec.check(config.head_dim)
            except ValueError as error:
                raise CmpchatError(str(error)) from None
        per_head = sum(codec.bytes_per_vector(config.head_dim) for codec in self.codecs)
        return len(layers) * config.num_kv_heads * per_head

    def allocate(self, config: ModelConfig, layers: Sequence[int], pages: int, page_tokens: int) -> CompressedPages:
        lead = (pages, page_tokens, config.num_kv_heads)
        hd = config.head_dim
        arrays = {
            layer: tuple(
                array
                for codec in self.codecs
                for array in (
                    cuda.device_array((*lead, codec.codes_per_vector(hd)), codec.code_dtype),
                    cuda.device_array((*lead, codec.scales_per_vector(hd)), codec.scale_dtype),
                )
            )
            for layer in layers
        }
        return CompressedPages(self.name, page_tokens, arrays)


@dataclass
class CompressedPages(KvPages):
    format_name: str
    page_tokens: int
    arrays: dict[int, tuple[Any, ...]]
    """attention layer -> (key codes, key scales, value codes, value scales), each [pages, page_tokens, Hkv, n]"""

    def caches(self, layer: int) -> tuple[Any, ...]:
        return self.arrays[layer]

    def copy(self, copies: Sequence[PageCopy], stream: Any) -> None:
        _copy_pages([array for arrays in self.arrays.values() for array in arrays], copies, stream)

    def zero(self, pages: Sequence[int], stream: Any) -> None:
        _zero_pages([array for arrays in self.arrays.values() for array in arrays], pages, stream)


FP16 = Fp16Layout()
LAYOUTS: dict[str, KvLayout] = {layout.name: layout for layout in (FP16, *map(CompressedLayout, GPU_FORMATS))}
"""Every GPU KV layout by its format's name (`kv_formats.FORMATS`)."""


def layout_named(name: str) -> KvLayout:
    """The layout of the KV format `name` (`kv_formats.FORMATS`); a one-line error for one the GPU does not run."""
    if name not in LAYOUTS:
        raise CmpchatError(
            f"the {name} KV cache runs on the CPU reference backend only (--backend cpu); "
            f"the cuda backend takes {', '.join(LAYOUTS)}"
        )
    return LAYOUTS[name]
