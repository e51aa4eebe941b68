"""The typed shape of a Qwen3.5 / Qwen3.6 dense hybrid model, read from `qwen35.*` GGUF metadata.

Every size comes from the file (docs/model.md: sizes are read from metadata, never assumed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_file import ModelFile

ARCHITECTURE = "qwen35"


class LayerKind(Enum):
    """What mixes tokens in a decoder layer."""

    RECURRENT = "gated_deltanet"
    ATTENTION = "gated_attention"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes and hyper-parameters of the text model; sizes in elements unless named otherwise."""

    name: str
    vocab_size: int
    hidden_size: int
    ffn_size: int
    context_length: int
    rms_eps: float
    layer_kinds: tuple[LayerKind, ...]
    num_mtp_layers: int
    tied_embeddings: bool
    # Gated full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dims: int
    rope_theta: float
    rope_sections: tuple[int, ...]
    # Gated DeltaNet.
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        checks = [
            (self.num_heads % self.num_kv_heads == 0, "attention heads are not a multiple of KV heads"),
            (self.num_v_heads % self.num_k_heads == 0, "GDN value heads are not a multiple of key heads"),
            (
                self.rope_dims % 2 == 0 and self.rope_dims <= self.head_dim,
                "RoPE dimension count is odd or exceeds the head size",
            ),
            (sum(self.rope_sections) <= self.rope_dims // 2, "RoPE sections exceed half the RoPE dimensions"),
            (self.hidden_size % 32 == 0, "hidden size is not a multiple of 32"),
        ]
        for ok, problem in checks:
            if not ok:
                raise CmpchatError(f"model '{self.name}': {problem}; the file's metadata is inconsistent")

    @property
    def num_layers(self) -> int:
        """Main decoder layers (MTP blocks excluded)."""
        return len(self.layer_kinds)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [Q all heads | K all heads | V all heads]."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.RECURRENT]

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one context token takes over all attention layers (fp16 by default)."""
        return len(self.attention_layers) * 2 * self.num_kv_heads * self.head_dim * bytes_per_value

    def recurrent_state_bytes(self, layers: Iterable[int] | None = None) -> int:
        """Bytes of conv and fp32 delta-rule state one sequence carries over the GDN layers among `layers`
        (default: all of them)."""
        per_layer = 4 * ((self.conv_kernel - 1) * self.conv_dim + self.num_v_heads * self.k_head_dim * self.v_head_dim)
        recurrent = self.recurrent_layers if layers is None else [i for i in layers if i in self.recurrent_layers]
        return len(recurrent) * per_layer

    @classmethod
    def from_model_file(cls, model_file: ModelFile) -> ModelConfig:
        arch = model_file.architecture
        if arch != ARCHITECTURE:
            raise CmpchatError(_unsupported_architecture(model_file.path.name, arch))
        key = _Keys(model_file)
        block_count = key.int("block_count")
        num_mtp = key.int("nextn_predict_layers", 0)
        num_layers = block_count - num_mtp
        recurrent = key.get("attention.recurrent_layers")
        if recurrent is not None:
            kinds = tuple(LayerKind.RECURRENT if flag else LayerKind.ATTENTION for flag in recurrent[:num_layers])
        else:
            interval = key.int("full_attention_interval", 4)
            kinds = tuple(
                LayerKind.ATTENTION if (i + 1) % interval == 0 else LayerKind.RECURRENT for i in range(num_layers)
            )
        num_v_heads = key.int("ssm.time_step_rank")
        embedding = model_file.tensor_info("token_embd.weight")
        return cls(
            name=str(model_file.get("general.name") or model_file.path.stem),
            vocab_size=embedding.shape[0],
            hidden_size=key.int("embedding_length"),
            ffn_size=key.int("feed_forward_length"),
            context_length=key.int("context_length"),
            rms_eps=float(key.get("attention.layer_norm_rms_epsilon", 1e-6)),
            layer_kinds=kinds,
            num_mtp_layers=num_mtp,
            tied_embeddings=not model_file.has_tensor("output.weight"),
            num_heads=key.int("attention.head_count"),
            num_kv_heads=key.int("attention.head_count_kv"),
            head_dim=key.int("attention.key_length"),
            rope_dims=key.int("rope.dimension_count"),
            rope_theta=float(key.get("rope.freq_base", 10_000_000.0)),
            rope_sections=tuple(int(s) for s in key.get("rope.dimension_sections", [0, 0, 0, 0])),
            conv_kernel=key.int("ssm.conv_kernel"),
            num_k_heads=key.int("ssm.group_count"),
            num_v_heads=num_v_heads,
            k_head_dim=key.int("ssm.state_size"),
            v_head_dim=key.int("ssm.inner_size") // num_v_heads,
        )


class _Keys:
    """`qwen35.`-prefixed metadata lookups; per-layer arrays must agree across layers."""

    def __init__(self, model_file: ModelFile) -> None:
        self._file = model_file

    def get(self, name: str, default: Any = None) -> Any:
        return self._file.get(f"{ARCHITECTURE}.{name}", default)

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            self._file.require(f"{ARCHITECTURE}.{name}")
        if isinstance(value, list):
            distinct = {v for v in value if v}
            if len(distinct) != 1:
                raise CmpchatError(
                    f"{self._file.path.name}: '{ARCHITECTURE}.{name}' varies per layer ({value}); cmpchat needs one value"
                )
            value = distinct.pop()
        return int(value)


def _unsupported_architecture(file_name: str, arch: str) -> str:
    if arch == "qwen35moe":
        return f"{file_name} is Qwen3.5 MoE (architecture 'qwen35moe'); cmpchat runs only the dense Qwen3.5/3.6 models (0.8B to 27B)"
    if arch == "clip":
        return f"{file_name} is a vision projector (mmproj), not a language model; pass the model itself with -m"
    if not arch:
        return f"{file_name} has no general.architecture key; it is not a model file cmpchat can run"
    return f"{file_name} is architecture '{arch}'; cmpchat runs only Qwen3.5/3.6 dense models (architecture 'qwen35')"
