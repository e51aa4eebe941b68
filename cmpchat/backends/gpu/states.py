"""The Gated DeltaNet states of every sequence a stage can hold: one slot per sequence, running or saved.

Per GDN layer a conv state fp32 [slots, K-1, conv_dim] (the last K-1 raw inputs) and a delta-rule state fp32
[slots, Hv, dk, dv]. Unlike the KV cache these cannot be shared or rewound, so a fork copies its slot (device
to device: ~50 MiB a sequence on 9B, ~150 MiB on 27B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmpchat.backends.gpu.buffers import fill_zero, zeros
from cmpchat.model.config import ModelConfig


@dataclass
class RecurrentStates:
    conv: dict[int, Any]
    """GDN layer -> fp32 [slots, K-1, conv_dim]"""
    delta: dict[int, Any]
    """GDN layer -> fp32 [slots, Hv, dk, dv]"""
    slots: int

    @classmethod
    def allocate(cls, config: ModelConfig, layers: Sequence[int], slots: int) -> RecurrentStates:
        conv_shape = (slots, config.conv_kernel - 1, config.conv_dim)
        delta_shape = (slots, config.num_v_heads, config.k_head_dim, config.v_head_dim)
        return cls({i: zeros(conv_shape) for i in layers}, {i: zeros(delta_shape) for i in layers}, slots)

    def clear(self, slot: int, stream: Any) -> None:
        for states in (self.conv, self.delta):
            for array in states.values():
                fill_zero(array[slot], stream)

    def copy(self, source: int, target: int, stream: Any) -> None:
        for states in (self.conv, self.delta):
            for array in states.values():
                array[target].copy_to_device(array[source], stream=stream)
