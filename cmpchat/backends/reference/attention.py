"""Gated full attention (QWEN35.md "Gated full-attention layer") over a growing KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmpchat.backends.reference.layers import Linear, apply_rope, rms_norm, rope_angles, sigmoid
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


@dataclass
class KvCache:
    """Keys (after norm and RoPE) and values of every token seen, [tokens, Hkv, hd]."""

    keys: np.ndarray
    values: np.ndarray

    @classmethod
    def empty(cls, config: ModelConfig, dtype: type) -> KvCache:
        shape = (0, config.num_kv_heads, config.head_dim)
        return cls(np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype))

    def copy(self) -> KvCache:
        return KvCache(self.keys.copy(), self.values.copy())


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

    def __call__(self, x: np.ndarray, cache: KvCache, positions: np.ndarray) -> np.ndarray:
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

        past = cache.keys.shape[0]
        cache.keys = np.concatenate([cache.keys, key.astype(cache.keys.dtype)])
        cache.values = np.concatenate([cache.values, value.astype(cache.values.dtype)])
        keys = cache.keys.astype(np.float32)
        values = cache.values.astype(np.float32)

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
