"""Gated full attention (docs/model.md, "Gated attention layer") over a paged KV cache in a KV format."""

from __future__ import annotations

import numpy as np

from cmpchat.backends.reference.layers import Linear, apply_rope, rms_norm, rope_angles, sigmoid
from cmpchat.kv_formats import KvFormat, Stored
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


class PagedKv:
    """The K/V pages of every attention layer: keys (after norm and RoPE) and values, [page_tokens, Hkv, hd] a
    page, stored in a KV format (`cmpchat.kv_formats`: encoded on write, decoded on read) and made on first use.
    Which pages a sequence holds is the pool's business (`kv_pool.PageList`).

    `rotated_attention`: attention reads the cache the way the GPU's kernels over a rotated format will (the
    query rotated once, scores and the values' sum in the rotated domain, one inverse transform per head
    output: `attend_rotated`) instead of decoding it first (`attend`, the specification); the two agree to
    fp32 rounding."""

    def __init__(
        self, config: ModelConfig, page_tokens: int, kv_format: KvFormat, *, rotated_attention: bool = False
    ) -> None:
        kv_format.check(config.head_dim)
        self.page_tokens = page_tokens
        self.format = kv_format
        self.rotated_attention = rotated_attention
        self._shape = (page_tokens, config.num_kv_heads, config.head_dim)
        self._pages: dict[tuple[int, int], tuple[Stored, Stored]] = {}

    def _page(self, layer: int, page: int) -> tuple[Stored, Stored]:
        entry = self._pages.get((layer, page))
        if entry is None:
            zeros = np.zeros(self._shape, np.float32)
            entry = self._pages[layer, page] = (self.format.key.encode(zeros), self.format.value.encode(zeros))
        return entry

    def write(self, layer: int, pages: list[int], start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store the K/V of tokens start, start+1, ... in their pages."""
        encoded = self.format.key.encode(keys), self.format.value.encode(values)
        for offset in range(keys.shape[0]):
            position = start + offset
            for stored, new in zip(self._page(layer, pages[position // self.page_tokens]), encoded, strict=True):
                for array, part in zip(stored, new, strict=True):
                    array[position % self.page_tokens] = part[offset]

    def stored(self, layer: int, pages: list[int], length: int) -> tuple[Stored, Stored]:
        """The stored arrays of the keys and of the values of tokens 0..length-1 ([length, Hkv, ...] each)."""
        used = [self._page(layer, page) for page in pages[: -(-length // self.page_tokens)]]
        keys = tuple(np.concatenate(parts)[:length] for parts in zip(*(page[0] for page in used), strict=True))
        values = tuple(np.concatenate(parts)[:length] for parts in zip(*(page[1] for page in used), strict=True))
        return keys, values

    def read(self, layer: int, pages: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of tokens 0..length-1, decoded: float32 [length, Hkv, hd]."""
        keys, values = self.stored(layer, pages, length)
        return self.format.key.decode(keys), self.format.value.decode(values)

    def read_rotated(self, layer: int, pages: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of tokens 0..length-1 in the domains attention reads them in (a rotated codec's:
        codebook values times the scale, no inverse transform), float32 [length, Hkv, hd]."""
        keys, values = self.stored(layer, pages, length)
        return self.format.key.decode_rotated(keys), self.format.value.decode_rotated(values)

    def copy_page(self, layers: list[int], source: int, target: int, tokens: int) -> None:
        """The first `tokens` tokens of page `source` into page `target`, in every attention layer."""
        for layer in layers:
            for src, dst in zip(self._page(layer, source), self._page(layer, target), strict=True):
                for src_array, dst_array in zip(src, dst, strict=True):
                    dst_array[:tokens] = src_array[:tokens]


def attend(query: np.ndarray, keys: np.ndarray, values: np.ndarray, past: int) -> np.ndarray:
    """Causal softmax attention of queries [T, H, hd] (tokens past, past+1, ...) over keys and values
    [past + T, Hkv, hd], scale hd^-1/2, query head h reading KV head h // (H / Hkv): [T, H, hd]."""
    steps, heads, head_dim = query.shape
    kv_head = np.arange(heads) // (heads // keys.shape[1])
    scores = np.einsum("thd,shd->hts", query, keys[:, kv_head]) * np.float32(head_dim**-0.5)
    visible = np.arange(past + steps)[None, :] <= (past + np.arange(steps))[:, None]  # causal, [T, S]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, values[:, kv_head])


def attend_rotated(
    query: np.ndarray, keys: np.ndarray, values: np.ndarray, past: int, kv_format: KvFormat
) -> np.ndarray:
    """`attend` over a cache read with `PagedKv.read_rotated`: the query is rotated once into the keys'
    domain, the weighted sum of the values is taken in theirs, and each head's output is rotated back once.
    Equal to `attend` over the decoded cache, up to fp32 rounding, because the rotation is orthonormal."""
    return kv_format.value.unrotate(attend(kv_format.key.rotate(query), keys, values, past))


class GatedAttention:
    def __init__(self, model_file: ModelFile, layer: int, config: ModelConfig, *, mirror_gpu: bool) -> None:
        prefix = f"blk.{layer}."
        self.config = config
        self.q = Linear(model_file, prefix + "attn_q.weight", mirror_gpu=mirror_gpu)
        self.k = Linear(model_file, prefix + "attn_k.weight", mirror_gpu=mirror_gpu)
        self.v = Linear(model_file, prefix + "attn_v.weight", mirror_gpu=mirror_gpu)
        self.out = Linear(model_file, prefix + "attn_output.weight", mirror_gpu=mirror_gpu)
        self.q_norm = model_file.dequantize(prefix + "attn_q_norm.weight")
        self.k_norm = model_file.dequantize(prefix + "attn_k_norm.weight")

    def linears(self) -> list[Linear]:
        return [self.q, self.k, self.v, self.out]

    def __call__(
        self, x: np.ndarray, kv: PagedKv, layer: int, pages: list[int], past: int, positions: np.ndarray
    ) -> np.ndarray:
        """The layer's output for `x`, the rows of tokens past, past+1, ... of the sequence holding `pages`."""
        cfg = self.config
        steps = x.shape[0]
        # Per head, the first hd outputs are the query and the next hd the output gate.
        query_gate = self.q(x).reshape(steps, cfg.num_heads, 2 * cfg.head_dim)
        query, gate = query_gate[..., : cfg.head_dim], query_gate[..., cfg.head_dim :]
        key = self.k(x).reshape(steps, cfg.num_kv_heads, cfg.head_dim)
        value = self.v(x).reshape(steps, cfg.num_kv_heads, cfg.head_dim)

        angles = rope_angles(positions, cfg.rope_dims, cfg.rope_theta, cfg.rope_sections)
        query = apply_rope(rms_norm(query, self.q_norm, cfg.rms_eps), angles)
        key = apply_rope(rms_norm(key, self.k_norm, cfg.rms_eps), angles)

        kv.write(layer, pages, past, key, value)
        if kv.rotated_attention:
            attended = attend_rotated(query, *kv.read_rotated(layer, pages, past + steps), past, kv.format)
        else:
            attended = attend(query, *kv.read(layer, pages, past + steps), past)
        return self.out((attended * sigmoid(gate)).reshape(steps, -1))
