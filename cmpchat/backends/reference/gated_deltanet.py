"""Gated DeltaNet mixer (docs/model.md, "Gated DeltaNet layer"), token by token: the recurrence is the spec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmpchat.backends.reference.layers import Linear, l2_normalize, rms_norm, sigmoid, silu, softplus
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


@dataclass
class RecurrentState:
    """What a GDN layer carries between calls for one sequence."""

    conv: np.ndarray
    """The last K-1 raw (pre-conv) qkv inputs [K-1, conv_dim]."""
    delta: np.ndarray
    """fp32 delta-rule state per value head [Hv, dk, dv]."""

    @classmethod
    def empty(cls, config: ModelConfig) -> RecurrentState:
        return cls(
            conv=np.zeros((config.conv_kernel - 1, config.conv_dim), dtype=np.float32),
            delta=np.zeros((config.num_v_heads, config.k_head_dim, config.v_head_dim), dtype=np.float32),
        )

    def copy(self) -> RecurrentState:
        return RecurrentState(self.conv.copy(), self.delta.copy())


class GatedDeltaNet:
    def __init__(self, model_file: ModelFile, layer: int, config: ModelConfig, *, mirror_gpu: bool) -> None:
        prefix = f"blk.{layer}."
        self.config = config
        self.qkv = Linear(model_file, prefix + "attn_qkv.weight", mirror_gpu=mirror_gpu)
        self.gate = Linear(model_file, prefix + "attn_gate.weight", mirror_gpu=mirror_gpu)
        self.beta = Linear(model_file, prefix + "ssm_beta.weight", mirror_gpu=mirror_gpu)
        self.alpha = Linear(model_file, prefix + "ssm_alpha.weight", mirror_gpu=mirror_gpu)
        self.out = Linear(model_file, prefix + "ssm_out.weight", mirror_gpu=mirror_gpu)
        self.dt_bias = model_file.dequantize(prefix + "ssm_dt.bias")
        self.a = model_file.dequantize(prefix + "ssm_a")  # already -exp(A_log)
        self.conv_weight = model_file.dequantize(prefix + "ssm_conv1d.weight").reshape(
            config.conv_dim, config.conv_kernel
        )
        self.norm_weight = model_file.dequantize(prefix + "ssm_norm.weight")

    def linears(self) -> list[Linear]:
        return [self.qkv, self.gate, self.beta, self.alpha, self.out]

    def __call__(self, x: np.ndarray, state: RecurrentState) -> np.ndarray:
        cfg = self.config
        steps = x.shape[0]
        mixed = self._causal_conv(self.qkv(x), state)
        q_end = cfg.num_k_heads * cfg.k_head_dim
        q = mixed[:, :q_end].reshape(steps, cfg.num_k_heads, cfg.k_head_dim)
        k = mixed[:, q_end : 2 * q_end].reshape(steps, cfg.num_k_heads, cfg.k_head_dim)
        v = mixed[:, 2 * q_end :].reshape(steps, cfg.num_v_heads, cfg.v_head_dim)
        q = l2_normalize(q) * np.float32(cfg.k_head_dim**-0.5)
        k = l2_normalize(k)
        # Value head h reads key head h % Hk (the GGUF converter re-tiled the value heads).
        key_head = np.arange(cfg.num_v_heads) % cfg.num_k_heads
        q, k = q[:, key_head], k[:, key_head]

        beta = sigmoid(self.beta(x))  # [T, Hv]
        decay = np.exp(self.a * softplus(self.alpha(x) + self.dt_bias))  # alpha = exp(g), g <= 0

        out = np.empty((steps, cfg.num_v_heads, cfg.v_head_dim), dtype=np.float32)
        s = state.delta
        for t in range(steps):
            s = s * decay[t][:, None, None]
            u = np.einsum("hkv,hk->hv", s, k[t])  # read with the already-decayed state
            delta = beta[t][:, None] * (v[t] - u)
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", s, q[t])
        state.delta = s.astype(np.float32, copy=False)

        z = self.gate(x).reshape(steps, cfg.num_v_heads, cfg.v_head_dim)
        gated = rms_norm(out, self.norm_weight, cfg.rms_eps) * silu(z)
        return self.out(gated.reshape(steps, -1))

    def _causal_conv(self, qkv: np.ndarray, state: RecurrentState) -> np.ndarray:
        """Depthwise causal conv over time with the carried history, then SiLU; updates the history."""
        kernel = self.config.conv_kernel
        history = np.concatenate([state.conv, qkv], axis=0)  # [K-1+T, C]
        steps = qkv.shape[0]
        conv = np.zeros_like(qkv)
        for tap in range(kernel):  # tap K-1 is the current token
            conv += history[tap : tap + steps] * self.conv_weight[:, tap]
        state.conv = history[-(kernel - 1) :].copy()
        return silu(conv)
