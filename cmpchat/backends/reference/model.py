"""The numpy reference backend: the whole Qwen3.5 text model, readable against docs/model.md.

Every step works on segments (a sequence plus the tokens it takes now): a prefill is one segment of many
tokens, a batched decode step is many segments of one token. Matmuls run over all segments' rows at once;
the mixers run per segment on that sequence's own state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cmpchat.backends.base import Backend, HostLogits, ImageRows, TokenInput, checked_images, host_tokens
from cmpchat.backends.kv_pool import PageList, PagePool, PoolExhausted
from cmpchat.backends.reference.attention import GatedAttention, PagedKv
from cmpchat.backends.reference.gated_deltanet import GatedDeltaNet, RecurrentState
from cmpchat.backends.reference.layers import Linear, rms_norm, silu, unpack_if_fits
from cmpchat.errors import CmpchatError
from cmpchat.kv_formats import F16, F32, KvFormat
from cmpchat.kv_formats import kv_format as kv_format_named
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile


@dataclass(eq=False)
class ReferenceSequence:
    """One sequence's state: its KV pages, a recurrent state per GDN layer, and the next text position."""

    pages: PageList
    recurrent: dict[int, RecurrentState]
    next_position: int = 0
    released: bool = False

    @property
    def length(self) -> int:
        return self.pages.length


@dataclass
class _Segment:
    sequence: ReferenceSequence
    tokens: np.ndarray
    positions: np.ndarray  # [T, 3] (t, h, w)
    past: int = 0
    """Tokens the sequence had read before this segment."""
    rows: slice = field(default_factory=lambda: slice(0))
    images: Sequence[ImageRows] = ()
    """Rows that replace the embeddings of some of its tokens."""


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

    def __call__(self, x: np.ndarray, segments: list[_Segment], layer: int, kv: PagedKv) -> np.ndarray:
        h = rms_norm(x, self.mixer_norm, self.eps)
        mixed = np.empty_like(x)
        for seg in segments:
            sequence = seg.sequence
            if isinstance(self.mixer, GatedAttention):
                mixed[seg.rows] = self.mixer(h[seg.rows], kv, layer, sequence.pages.pages, seg.past, seg.positions)
            else:
                mixed[seg.rows] = self.mixer(h[seg.rows], sequence.recurrent[layer])
        x = x + mixed
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


class ReferenceBackend(Backend[ReferenceSequence]):
    """fp32 numpy model. `mirror_gpu=True` rounds as the GPU engine does (int8 activations, fp16 KV).

    `kv` is the KV cache's format (`cmpchat.kv_formats`: a name such as "tq3", the baselines' too); default fp32
    (fp16 with `mirror_gpu`). `rotated_attention` reads a rotated format as the GPU kernels will
    (`attention.attend_rotated`) instead of decoding it first; the two agree to fp32 rounding.

    KV caches live in a pool of `pool_tokens` tokens in pages of `page_tokens` (made as they are first used, so
    a large pool costs nothing until it fills); `max_sequences` bounds the sequences held at once, as a GPU's
    recurrent-state slots do, and `context` the tokens of one sequence.
    """

    name = "cpu"
    max_batch = 16
    reads_images = True

    def __init__(
        self,
        model_file: ModelFile,
        config: ModelConfig | None = None,
        *,
        mirror_gpu: bool = False,
        context: int | None = None,
        pool_tokens: int | None = None,
        page_tokens: int = 256,
        max_sequences: int = 64,
        kv: str | KvFormat | None = None,
        rotated_attention: bool = False,
    ) -> None:
        self.config = config or ModelConfig.from_model_file(model_file)
        self.model_file = model_file
        self.mirror_gpu = mirror_gpu
        cfg = self.config
        self.layers = [DecoderLayer(model_file, i, cfg, mirror_gpu=mirror_gpu) for i in range(cfg.num_layers)]
        self.output_norm = model_file.dequantize("output_norm.weight")
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.lm_head = Linear(model_file, head_name, mirror_gpu=mirror_gpu)
        self.weights_unpacked = _hold_weights(model_file, self.linears())
        context_limit = min(context or cfg.context_length, cfg.context_length)
        pool_tokens = pool_tokens or 4 * context_limit
        self.pool = PagePool(-(-pool_tokens // page_tokens), page_tokens)
        # One sequence can always grow to its limit once the others give their pages back.
        self.context_limit = min(context_limit, self.pool.total_tokens)
        if kv is None:
            kv_format = F16 if mirror_gpu else F32
        else:
            kv_format = kv_format_named(kv) if isinstance(kv, str) else kv
        self.kv = PagedKv(cfg, page_tokens, kv_format, rotated_attention=rotated_attention)
        self.max_sequences = max_sequences
        self._held = 0
        self._kv_chosen = kv is not None

    def describe(self) -> list[str]:
        lines = []
        if not self.weights_unpacked:
            fp32 = sum(linear.unpacked_bytes for linear in self.linears())
            lines.append(
                f"weights: kept packed and dequantised in every matmul (slow), since their fp32 values "
                f"({fp32 / 2**30:.1f} GiB) do not fit in RAM"
            )
        if self._kv_chosen:
            fmt = self.kv.format
            lines.append(
                f"KV cache: {fmt.name} ({fmt.bits_per_value:g} bits a value, {fmt.bytes_per_token(self.config):,} "
                "bytes a token)"
            )
        return lines

    # -- sequences --------------------------------------------------------------------------------

    @property
    def held_sequences(self) -> int:
        return self._held

    def new_sequence(self) -> ReferenceSequence:
        self._take_sequence()
        states = {i: RecurrentState.empty(self.config) for i in self.config.recurrent_layers}
        return ReferenceSequence(PageList(self.pool), states)

    def fork(self, sequence: ReferenceSequence) -> ReferenceSequence:
        _check_live(sequence)
        self._take_sequence()
        states = {i: state.copy() for i, state in sequence.recurrent.items()}
        return ReferenceSequence(sequence.pages.share(), states, sequence.next_position)

    def release(self, sequence: ReferenceSequence) -> None:
        if not sequence.released:
            sequence.pages.release()
            sequence.released = True
            self._held -= 1

    def length(self, sequence: ReferenceSequence) -> int:
        return sequence.length

    def pages_to_grow(self, sequence: ReferenceSequence, tokens: int) -> int:
        return sequence.pages.pages_to_grow(tokens)

    def _take_sequence(self) -> None:
        if self._held >= self.max_sequences:
            raise CmpchatError(f"all {self.max_sequences} sequence states are in use; finish a conversation first")
        self._held += 1

    # -- steps ------------------------------------------------------------------------------------

    def prefill(
        self, sequence: ReferenceSequence, tokens: Sequence[int], *, positions: np.ndarray | None = None
    ) -> HostLogits:
        hidden = self._forward([self._segment(sequence, tokens, positions)])
        return HostLogits(self._logits(hidden[-1:]))

    def prefill_with_images(
        self,
        sequence: ReferenceSequence,
        tokens: Sequence[int],
        *,
        positions: np.ndarray,
        images: Sequence[ImageRows],
    ) -> HostLogits:
        segment = self._segment(sequence, tokens, positions)
        segment.images = checked_images(images, len(segment.tokens), self.config.hidden_size)
        return HostLogits(self._logits(self._forward([segment])[-1:]))

    def score(self, sequence: ReferenceSequence, tokens: Sequence[int]) -> np.ndarray:
        return self._logits(self._forward([self._segment(sequence, tokens, None)]))

    def decode(
        self, sequences: Sequence[ReferenceSequence], tokens: Sequence[TokenInput], *, group: int = 0
    ) -> HostLogits:
        if len(sequences) != len(tokens):
            raise ValueError("one token per sequence")
        if not 1 <= len(sequences) <= self.max_batch:
            raise ValueError(f"a decode step takes 1 to {self.max_batch} sequences, got {len(sequences)}")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one decode step")
        ids = host_tokens(tokens)
        segments = [self._segment(seq, [tok], None) for seq, tok in zip(sequences, ids, strict=True)]
        return HostLogits(self._logits(self._forward(segments)))

    # -- the model --------------------------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding rows, dequantised exactly from the mapped file."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return self.model_file.dequantize("token_embd.weight", rows=tokens)

    def _segment(self, sequence: ReferenceSequence, tokens: Sequence[int], positions: np.ndarray | None) -> _Segment:
        _check_live(sequence)
        token_array = np.asarray(tokens, dtype=np.int64)
        if token_array.size == 0:
            raise ValueError("a step needs at least one token")
        if positions is None:
            text = sequence.next_position + np.arange(len(token_array))
            positions = np.repeat(text[:, None], 3, axis=1)
        positions = np.asarray(positions, dtype=np.int64)
        if positions.shape != (len(token_array), 3):
            raise ValueError("positions must be [T, 3] (t, h, w)")
        if sequence.length + len(token_array) > self.context_limit:
            raise CmpchatError(
                f"{sequence.length + len(token_array)} tokens do not fit the {self.context_limit}-token context; "
                "start a new conversation or shorten the prompt"
            )
        return _Segment(sequence, token_array, positions, past=sequence.length)

    def _forward(self, segments: list[_Segment]) -> np.ndarray:
        x = self.embed(np.concatenate([seg.tokens for seg in segments]))  # checks the ids before pages move
        needed = sum(seg.sequence.pages.pages_to_grow(len(seg.tokens)) for seg in segments)
        if needed > self.pool.free_pages:
            raise PoolExhausted(f"this step needs {needed} KV pages but {self.pool.free_pages} are free")
        start = 0
        for seg in segments:
            seg.rows = slice(start, start + len(seg.tokens))
            for image in seg.images:
                x[start + image.start : start + image.start + len(image.rows)] = image.rows
            start += len(seg.tokens)
            for copy in seg.sequence.pages.grow(len(seg.tokens)):
                self.kv.copy_page(self.config.attention_layers, copy.source, copy.target, copy.tokens)
        for index, layer in enumerate(self.layers):
            x = layer(x, segments, index, self.kv)
        for seg in segments:
            seg.sequence.next_position = int(seg.positions.max()) + 1
        return x

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.lm_head(rms_norm(hidden, self.output_norm, self.config.rms_eps))

    def linears(self) -> list[Linear]:
        """Every weight matrix the model multiplies by, the LM head last."""
        return [linear for layer in self.layers for linear in layer.linears()] + [self.lm_head]


def _check_live(sequence: ReferenceSequence) -> None:
    if sequence.released:
        raise ValueError("the sequence was released")


def _hold_weights(model_file: ModelFile, linears: list[Linear]) -> bool:
    """Unpack every matrix to fp32 when they all fit in RAM (fast); else keep them packed in the mapped file and
    dequantise them per call (slow, but a 9B Q4_K_M runs without 36 GB of fp32). Refused, with the numbers, only
    when even the packed weights would not fit. Returns whether the weights were unpacked."""
    available = _available_memory()
    if unpack_if_fits(linears, available):
        return True
    packed = sum(linear.file_bytes for linear in linears)
    if available is not None and packed > 0.9 * available:
        raise CmpchatError(
            f"the CPU reference backend needs {packed / 2**30:.1f} GiB of RAM for {model_file.path.name}'s weights "
            f"but {available / 2**30:.1f} GiB is available; use the cuda backend or a smaller model"
        )
    return False


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
