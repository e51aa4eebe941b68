"""Gated full attention (docs/model.md, "Gated attention layer") over a paged KV cache."""

from __future__ import annotations

import numpy as np

from cmpchat.backends.reference.layers import Linear, apply_rope, rms_norm, rope_angles, sigmoid
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


class PagedKv:
    """The K/V pages of every attention layer: keys (after norm and RoPE) and values, [page_tokens, Hkv, hd] a
    page, made on first use. Which pages a sequence holds is the pool's business (`kv_pool.PageList`)."""

    def __init__(self, config: ModelConfig, page_tokens: int, dtype: type) -> None:
        self.page_tokens = page_tokens
        self.dtype = dtype
        self._shape = (page_tokens, config.num_kv_heads, config.head_dim)
        self._pages: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _page(self, layer: int, page: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self._pages.get((layer, page))
        if entry is None:
            entry = self._pages[layer, page] = (np.zeros(self._shape, self.dtype), np.zeros(self._shape, self.dtype))
        return entry

    def write(self, layer: int, pages: list[int], start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store the K/V of tokens start, start+1, ... in their pages."""
        for offset in range(keys.shape[0]):
            position = start + offset
            page_keys, page_values = self._page(layer, pages[position // self.page_tokens])
            page_keys[position % self.page_tokens] = keys[offset]
            page_values[position % self.page_tokens] = values[offset]

    def read(self, layer: int, pages: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of tokens 0..length-1, float32 [length, Hkv, hd]."""
        used = pages[: -(-length // self.page_tokens)]
        keys = np.concatenate([self._page(layer, page)[0] for page in used])[:length]
        values = np.concatenate([self._page(layer, page)[1] for page in used])[:length]
        return keys.astype(np.float32), values.astype(np.float32)

    def copy_page(self, layers: list[int], source: int, target: int, tokens: int) -> None:
        """The first `tokens` tokens of page `source` into page `target`, in every attention layer."""
        for layer in layers:
            for src, dst in zip(self._page(layer, source), self._page(layer, target), strict=True):
                dst[:tokens] = src[:tokens]


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

        kv.write(layer, pages, past, key.astype(kv.dtype), value.astype(kv.dtype))
        keys, values = kv.read(layer, pages, past + steps)

        group = cfg.num_heads // cfg.num_kv_heads
        kv_head = np.arange(cfg.num_heads) // group
        scores = np.einsum("thd,shd->hts", query, keys[:, kv_head]) * np.float32(cfg.head_dim**-0.5)
        visible = np.arange(past + steps)[None, :] <= (past + np.arange(steps))[:, None]  # causal, [T, S]
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", weights, values[:, kv_head])
        return self.out((attended * sigmoid(gate)).reshape(steps, -1))
