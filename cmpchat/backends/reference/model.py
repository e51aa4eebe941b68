"""The numpy reference backend: the whole Qwen3.5 text model, readable against QWEN35.md.

Every step works on segments (a sequence plus the tokens it takes now): a prefill is one segment of many
tokens, a batched decode step is many segments of one token. Matmuls run over all segments' rows at once;
the mixers run per segment on that sequence's own state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cmpchat.backends.base import Backend
from cmpchat.backends.reference.attention import GatedAttention, KvCache
from cmpchat.backends.reference.gated_deltanet import GatedDeltaNet, RecurrentState
from cmpchat.backends.reference.layers import Linear, linear_weight_bytes, rms_norm, silu
from cmpchat.errors import CmpchatError
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile


@dataclass
class ReferenceSequence:
    """One conversation's state: per layer a KV cache or a recurrent state, and the next text position."""

    layers: list[KvCache | RecurrentState]
    length: int = 0
    next_position: int = 0

    def copy(self) -> ReferenceSequence:
        return ReferenceSequence([s.copy() for s in self.layers], self.length, self.next_position)


@dataclass
class _Segment:
    sequence: ReferenceSequence
    tokens: np.ndarray
    positions: np.ndarray  # [T, 3] (t, h, w)
    rows: slice = field(default_factory=lambda: slice(0))


class FeedForward:
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, model_file: ModelFile, layer: int, *, mirror_gpu: bool) -> None:
        prefix = f"blk.{layer}."
        self.gate = Linear(model_file, prefix + "ffn_gate.weight", mirror_gpu=mirror_gpu)
        self.up = Linear(model_file, prefix + "ffn_up.weight", mirror_gpu=mirror_gpu)
        self.down = Linear(model_file, prefix + "ffn_down.weight", mirror_gpu=mirror_gpu)

    def linears(self) -> list[Linear]:
        return [self.gate, self.up, self.down]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down(silu(self.gate(x)) * self.up(x))


class DecoderLayer:
    def __init__(self, model_file: ModelFile, layer: int, config: ModelConfig, *, mirror_gpu: bool) -> None:
        prefix = f"blk.{layer}."
        self.kind = config.layer_kinds[layer]
        self.eps = config.rms_eps
        self.mixer_norm = model_file.dequantize(prefix + "attn_norm.weight")
        self.mlp_norm = model_file.dequantize(prefix + "post_attention_norm.weight")
        mixer_type = GatedAttention if self.kind is LayerKind.ATTENTION else GatedDeltaNet
        self.mixer = mixer_type(model_file, layer, config, mirror_gpu=mirror_gpu)
        self.mlp = FeedForward(model_file, layer, mirror_gpu=mirror_gpu)

    def linears(self) -> list[Linear]:
        return self.mixer.linears() + self.mlp.linears()

    def __call__(self, x: np.ndarray, segments: list[_Segment], layer: int) -> np.ndarray:
        h = rms_norm(x, self.mixer_norm, self.eps)
        mixed = np.empty_like(x)
        for seg in segments:
            state = seg.sequence.layers[layer]
            if isinstance(self.mixer, GatedAttention):
                mixed[seg.rows] = self.mixer(h[seg.rows], state, seg.positions)
            else:
                mixed[seg.rows] = self.mixer(h[seg.rows], state)
        x = x + mixed
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


class ReferenceBackend(Backend):
    """fp32 numpy model. `mirror_gpu=True` rounds as the GPU engine does (int8 activations, fp16 KV)."""

    name = "cpu"

    def __init__(self, model_file: ModelFile, config: ModelConfig | None = None, *, mirror_gpu: bool = False) -> None:
        self.config = config or ModelConfig.from_model_file(model_file)
        self.model_file = model_file
        self.mirror_gpu = mirror_gpu
        _check_host_memory(model_file, self.config)
        cfg = self.config
        self.layers = [DecoderLayer(model_file, i, cfg, mirror_gpu=mirror_gpu) for i in range(cfg.num_layers)]
        self.output_norm = model_file.dequantize("output_norm.weight")
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.lm_head = Linear(model_file, head_name, mirror_gpu=mirror_gpu)
        self._kv_dtype = np.float16 if mirror_gpu else np.float32

    # -- Backend interface ------------------------------------------------------------------------

    def new_sequence(self) -> ReferenceSequence:
        cfg = self.config
        states: list[KvCache | RecurrentState] = [
            KvCache.empty(cfg, self._kv_dtype) if kind is LayerKind.ATTENTION else RecurrentState.empty(cfg)
            for kind in cfg.layer_kinds
        ]
        return ReferenceSequence(states)

    def copy_sequence(self, sequence: ReferenceSequence) -> ReferenceSequence:
        return sequence.copy()

    def sequence_length(self, sequence: ReferenceSequence) -> int:
        return sequence.length

    def prefill(
        self,
        sequence: ReferenceSequence,
        tokens: Sequence[int],
        *,
        positions: np.ndarray | None = None,
        all_logits: bool = False,
    ) -> np.ndarray:
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        segment = self._segment(sequence, tokens, positions)
        hidden = self._forward([segment])
        return self._logits(hidden if all_logits else hidden[-1:])[slice(None) if all_logits else 0]

    def decode(self, sequences: Sequence[ReferenceSequence], tokens: Sequence[int]) -> np.ndarray:
        if len(sequences) != len(tokens):
            raise ValueError("one token per sequence")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one decode step")
        segments = [self._segment(seq, [tok], None) for seq, tok in zip(sequences, tokens)]
        return self._logits(self._forward(segments))

    # -- the model --------------------------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding rows, dequantised exactly from the mapped file."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return self.model_file.dequantize("token_embd.weight", rows=tokens)

    def _segment(self, sequence: ReferenceSequence, tokens: Sequence[int], positions: np.ndarray | None) -> _Segment:
        token_array = np.asarray(tokens, dtype=np.int64)
        if positions is None:
            text = sequence.next_position + np.arange(len(token_array))
            positions = np.repeat(text[:, None], 3, axis=1)
        positions = np.asarray(positions, dtype=np.int64)
        if positions.shape != (len(token_array), 3):
            raise ValueError("positions must be [T, 3] (t, h, w)")
        return _Segment(sequence, token_array, positions)

    def _forward(self, segments: list[_Segment]) -> np.ndarray:
        start = 0
        for seg in segments:
            seg.rows = slice(start, start + len(seg.tokens))
            start += len(seg.tokens)
        x = self.embed(np.concatenate([seg.tokens for seg in segments]))
        for index, layer in enumerate(self.layers):
            x = layer(x, segments, index)
        for seg in segments:
            seg.sequence.length += len(seg.tokens)
            seg.sequence.next_position = int(seg.positions.max()) + 1
        return x

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.lm_head(rms_norm(hidden, self.output_norm, self.config.rms_eps))


def _check_host_memory(model_file: ModelFile, config: ModelConfig) -> None:
    """Refuse, with the numbers, a model whose fp32 weights would not fit in available RAM."""
    names = [name for name, info in model_file.tensors.items() if len(info.shape) == 2 and name != "token_embd.weight"]
    if config.tied_embeddings:
        names.append("token_embd.weight")
    needed = sum(linear_weight_bytes(model_file, name) for name in names)
    available = _available_memory()
    if available is not None and needed > 0.9 * available:
        raise CmpchatError(
            f"the CPU reference backend needs {needed / 2**30:.1f} GiB of RAM for {model_file.path.name} "
            f"(fp32 weights) but {available / 2**30:.1f} GiB is available; use the cuda backend or a smaller model"
        )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
