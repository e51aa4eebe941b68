"""A long prompt's step: consecutive tokens of one sequence (PROMPT_ROWS, or PIPELINE_PROMPT_ROWS in a pipeline)
through the whole model at once.

Where a decode step reads every weight once per token (or per 16 tokens of a short prompt chunk), this
step reads it once per step's tokens, so its matmuls are the DP4A GEMM (`gemm.py`), dp4a-bound on a
CMP rather than bandwidth-bound. Layer by layer, as `step.decode_launches`:

    x = embed(tokens)                                                     [rows, d]
                (an image's rows are copied into x before the step; the embedding leaves them)
    per layer:  p = W_in rms_norm_quantize(x)
                attention:  q, K/V cache = qk_norm_rope(p);  a = attention(q, cache) * sigmoid(gate)
                            (FlashAttention-style, `attention_prefill`: each row attends to the cache up to
                            itself, the step wrote the rows' K/V first; a tile of rows shares each K/V read)
                GDN:        a = `gated_deltanet_chunked` over the rows in chunks of 64, state in place
                x += W_out quantize(a)
                x += W_down quantize(swiglu(W_gate|up rms_norm_quantize(x)))
    logits = W_lm rms_norm_quantize(x[last row])                          [1, vocab]

The launches are fixed per sequence slot (the GDN kernels take the slot as an argument), so the backend
builds and captures them once per slot; the rows' tokens and positions are uploaded before each replay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.base import ImageRows
from cmpchat.backends.gpu.buffers import columns, mark_placed, place_image_rows, zeros
from cmpchat.backends.gpu.kv_layout import FP16, KvPages
from cmpchat.backends.gpu.states import RecurrentStates
from cmpchat.backends.gpu.step import MatmulInputs, embed_launch, takes_int8
from cmpchat.backends.gpu.weights import AttentionWeights, RecurrentWeights, StageWeights
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.attention_prefill import (
    PrefillAttentionConfig,
    compressed_prefill_attention,
    partial_buffer_shapes,
    prefill_attention,
)
from cmpchat.kernels.device_table import DeviceTuning
from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, GatedDeltaNetWeights
from cmpchat.kernels.gated_deltanet_chunked import (
    DEFAULT_CHUNK,
    ChunkWorkspace,
    check_prefill_shape,
    prefill_launches,
)
from cmpchat.kernels.kv_write import kv_write_launch
from cmpchat.kernels.qk_norm_rope import qk_norm_rope_launch, qk_norm_rope_rows_launch, rope_tables
from cmpchat.model.config import ModelConfig

PROMPT_ROWS = 256
"""Tokens per long-prompt step of one stage: well into the GEMM's dp4a-bound regime (from ~64 tokens on a CMP),
while the activations stay small (~90 MB at 27B) and a prompt's tail below it takes the 16-row step."""

PIPELINE_PROMPT_ROWS = 128
"""Tokens per long-prompt step of a pipeline of several stages: half the chunk halves the pipeline's fill and
drain and each hop's copies, and the GEMM stays dp4a-bound on a CMP (docs/performance.md, Multi-GPU pipeline)."""


def prompt_rows(stages: int) -> int:
    """Tokens per long-prompt step of a pipeline of `stages` stages."""
    return PROMPT_ROWS if stages == 1 else PIPELINE_PROMPT_ROWS


def prompt_step_supported(config: ModelConfig, weights: StageWeights) -> str | None:
    """Why this stage cannot take the long-prompt step (then prompts run 16 tokens at a time), or None."""
    matrices = [] if weights.lm_head is None else [weights.lm_head]
    for layer in weights.layers.values():
        mixer = layer.mixer
        inner = mixer.qkv if isinstance(mixer, AttentionWeights) else mixer.projection
        matrices += [inner, mixer.output, layer.gate_up, layer.down]
    if not all(takes_int8(m) for m in matrices):
        return "the long-prompt step multiplies Q8_0 and 4/5/6-bit weights only"
    if config.recurrent_layers:
        try:
            check_prefill_shape(GatedDeltaNetShape.from_config(config), DEFAULT_CHUNK)
        except ValueError as error:
            return str(error)
    return None


@dataclass
class PromptBuffers:
    """Device buffers of one long-prompt step (PROMPT_ROWS rows)."""

    inputs: Any  # int32 [rows * 5]: tokens [rows] | positions [rows, 4]
    tokens: Any  # } views of `inputs`
    positions: Any  # (cache index, t, h, w) per row
    page_table: Any  # int32 [rows, pages per row]: every row holds the sequence's pages
    hidden: Any  # fp32 [rows, d]
    normalized: Any  # fp32 [rows, d]
    x_quants: Any  # uint32 [rows, d/4]
    x_scales: Any  # fp32 [rows, d/32]
    projection: Any  # fp32 [rows, widest fused input projection]
    conv_out: Any  # fp32 [rows, conv_dim]: the GDN conv's output (it may not overwrite the projection)
    mixed: Any  # fp32 [rows, max(H*hd, Hv*dv, ffn)]
    m_quants: Any
    m_scales: Any
    q: Any  # fp32 [rows, H, hd]
    k_rows: Any  # fp32 [rows, Hkv, hd]: the new keys on their way into a compressed cache (`kv_write`)
    attention: PrefillAttentionConfig
    partial_acc: Any  # fp32 [rows, H, splits, hd]: prefill attention's per-split partials
    partial_ml: Any  # fp32 [rows, H, splits, 2]
    logits: Any  # fp32 [1, V]: the last row's
    arrival: Any  # fp32 [rows, d] or None: where a pipeline's previous stage's hidden states land
    departure: Any  # fp32 [rows, d] or None: where they leave for the next stage from
    inv_freq: Any
    freq_axis: Any
    gdn_workspace: ChunkWorkspace | None  # the chunked Gated DeltaNet's, shared by the layers (None: no GDN)
    _known_pages: list[int] = field(default_factory=list)
    """The pages the device's page table holds."""

    @staticmethod
    def attention_config(config: ModelConfig, tuning: DeviceTuning, sm_count: int, rows: int) -> PrefillAttentionConfig:
        """How the step's attention is tiled (`tuning`'s) and split over keys to fill `sm_count` SMs."""
        return tuning.prefill_attention_config(rows, config.num_heads, config.num_kv_heads, sm_count)

    @classmethod
    def layout(
        cls,
        config: ModelConfig,
        tuning: DeviceTuning,
        sm_count: int,
        rows: int,
        pages_per_row: int = 1,
        *,
        receives: bool = False,
        sends: bool = False,
    ) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Shape and dtype of every buffer the step allocates (the rows' inputs as one int32 array); `receives`
        and `sends`: a pipeline stage's staging buffers for the hand-offs from the stage before and to the next
        (`bridge.OverlappedHandOff`)."""
        d = config.hidden_size
        widest = max(
            2 * (config.num_heads + config.num_kv_heads) * config.head_dim,
            config.conv_dim + config.num_v_heads * config.v_head_dim + 2 * config.num_v_heads,
        )
        mixed = max(config.num_heads * config.head_dim, config.num_v_heads * config.v_head_dim, config.ffn_size)
        attention = cls.attention_config(config, tuning, sm_count, rows)
        acc_shape, ml_shape = partial_buffer_shapes(rows, config.num_heads, config.head_dim, attention)
        f32, u32 = np.float32, np.uint32
        staging = {"arrival": receives, "departure": sends}
        return {
            **{name: ((rows, d), f32) for name, wanted in staging.items() if wanted},
            "inputs": ((5 * rows,), np.int32),
            "page_table": ((rows, pages_per_row), np.int32),
            "hidden": ((rows, d), f32),
            "normalized": ((rows, d), f32),
            "x_quants": ((rows, d // 4), u32),
            "x_scales": ((rows, d // 32), f32),
            "projection": ((rows, widest), f32),
            "conv_out": ((rows, config.conv_dim), f32),
            "mixed": ((rows, mixed), f32),
            "m_quants": ((rows, mixed // 4), u32),
            "m_scales": ((rows, mixed // 32), f32),
            "q": ((rows, config.num_heads, config.head_dim), f32),
            "k_rows": ((rows, config.num_kv_heads, config.head_dim), f32),
            "partial_acc": (acc_shape, f32),
            "partial_ml": (ml_shape, f32),
            "logits": ((1, config.vocab_size), f32),
        }

    @classmethod
    def reserved_bytes(
        cls,
        config: ModelConfig,
        tuning: DeviceTuning,
        sm_count: int,
        rows: int = PROMPT_ROWS,
        pages_per_row: int = 1,
        *,
        receives: bool = False,
        sends: bool = False,
    ) -> int:
        """What `allocate` takes on the GPU, for the memory plan."""
        rope = rope_tables(config.rope_dims, config.rope_theta, config.rope_sections)
        layout = cls.layout(config, tuning, sm_count, rows, pages_per_row, receives=receives, sends=sends)
        arrays = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout.values())
        workspace = (
            ChunkWorkspace.nbytes(GatedDeltaNetShape.from_config(config), rows) if config.recurrent_layers else 0
        )
        return arrays + rope.inv_freq.nbytes + rope.freq_axis.nbytes + workspace

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        tuning: DeviceTuning,
        sm_count: int,
        rows: int = PROMPT_ROWS,
        pages_per_row: int = 1,
        *,
        receives: bool = False,
        sends: bool = False,
    ) -> PromptBuffers:
        layout = cls.layout(config, tuning, sm_count, rows, pages_per_row, receives=receives, sends=sends)
        arrays = {name: zeros(shape, dtype) for name, (shape, dtype) in layout.items()}
        arrays.setdefault("arrival", None)
        arrays.setdefault("departure", None)
        inputs = arrays["inputs"]
        rope = rope_tables(config.rope_dims, config.rope_theta, config.rope_sections)
        return cls(
            **arrays,
            tokens=inputs[:rows],
            positions=inputs[rows:].reshape(rows, 4),
            attention=cls.attention_config(config, tuning, sm_count, rows),
            inv_freq=cuda.to_device(rope.inv_freq),
            freq_axis=cuda.to_device(rope.freq_axis),
            gdn_workspace=(
                ChunkWorkspace.allocate(GatedDeltaNetShape.from_config(config), rows)
                if config.recurrent_layers
                else None
            ),
        )

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def upload(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        pages: Sequence[int],
        stream: Any,
        images: Sequence[ImageRows] = (),
    ) -> None:
        """The rows' token ids and (cache index, t, h, w) positions, the pages of their sequence, and (on the
        first stage) `images`: rows copied into the hidden states in place of their tokens' embeddings. Every row
        needs the page table (each writes its own token's K/V): row 0 goes up when it changed and is copied to
        the others on the device, doubling the rows copied each time (8 copies for 256 rows)."""
        rows = self.rows
        host = np.empty(5 * rows, np.int32)
        host[:rows] = tokens
        mark_placed(host[:rows], images)
        host[rows:] = positions.reshape(-1)
        self.inputs.copy_to_device(host, stream=stream)  # pageable: staged before the call returns
        place_image_rows(self.hidden, images, stream)
        known = self._known_pages
        if list(pages) == known:
            return
        if len(pages) > self.page_table.shape[1]:
            raise ValueError(f"{len(pages)} pages exceed the {self.page_table.shape[1]} the page table holds")
        row = np.zeros(self.page_table.shape[1], np.int32)
        row[: len(pages)] = pages
        self.page_table[0].copy_to_device(row, stream=stream)
        filled = 1
        while filled < rows:
            count = min(filled, rows - filled)
            self.page_table[filled : filled + count].copy_to_device(self.page_table[:count], stream=stream)
            filled += count
        self._known_pages = list(pages)


def prompt_launches(
    config: ModelConfig,
    weights: StageWeights,
    kv: KvPages,
    states: RecurrentStates,
    buffers: PromptBuffers,
    slot: int,
    sm_count: int,
    tuning: DeviceTuning,
) -> list[Launch]:
    """Every launch of one long-prompt step of a stage's layers for sequence state slot `slot`, in order (grids
    for `sm_count` SMs, `tuning`'s tilings; the attention's is the buffers', `buffers.attention`)."""
    b = buffers
    rows = b.rows
    hidden = b.hidden
    eps = config.rms_eps
    gdn_shape = GatedDeltaNetShape.from_config(config)

    inputs = MatmulInputs(b, rows, eps, sm_count, tuning)

    launches = []
    if weights.embedding is not None:
        launches.append(embed_launch(weights.embedding, b.tokens, hidden))
    for index, layer in weights.layers.items():
        mixer = layer.mixer
        if isinstance(mixer, AttentionWeights):
            projection = columns(b.projection, rows, mixer.qkv.rows)
            launches += inputs.normed(mixer.qkv, hidden, layer.mixer_norm, projection)
            caches = kv.caches(index)
            tables = (mixer.q_norm, mixer.k_norm, b.inv_freq, b.freq_axis, eps)
            attended = columns(b.mixed, rows, config.num_heads * config.head_dim)
            split_args = (b.partial_acc, b.partial_ml, attended, b.attention)
            if kv.format_name == FP16.name:
                k_cache, v_cache = caches
                launches.append(
                    qk_norm_rope_launch(projection, b.positions, b.page_table, *tables, b.q, k_cache, v_cache)
                )
                launches += prefill_attention(b.q, projection, b.positions, b.page_table, k_cache, v_cache,
                                              *split_args)  # fmt: skip
            else:
                launches.append(qk_norm_rope_rows_launch(projection, b.positions, *tables, b.q, b.k_rows))
                launches.append(kv_write_launch(b.k_rows, projection, b.positions, b.page_table, caches,
                                                kv.format_name))  # fmt: skip
                launches += compressed_prefill_attention(b.q, projection, b.positions, b.page_table, caches,
                                                         kv.format_name, *split_args)  # fmt: skip
        else:
            assert isinstance(mixer, RecurrentWeights)
            projection = columns(b.projection, rows, mixer.projection.rows)
            launches += inputs.normed(mixer.projection, hidden, layer.mixer_norm, projection)
            attended = columns(b.mixed, rows, gdn_shape.output_width)
            gdn_weights = GatedDeltaNetWeights(mixer.conv_weight, mixer.ssm_a, mixer.dt_bias, mixer.norm_weight)
            launches += prefill_launches(gdn_shape, gdn_weights, projection, states.conv[index],
                                         states.delta[index], slot, attended, mixed=b.conv_out,
                                         workspace=b.gdn_workspace)  # fmt: skip
        launches += inputs.project_into(mixer.output, attended, hidden)
        activated = columns(b.mixed, rows, config.ffn_size)
        launches += inputs.normed(layer.gate_up, hidden, layer.mlp_norm, activated, mode="swiglu")
        launches += inputs.project_into(layer.down, activated, hidden)
    if weights.lm_head is not None:
        last = MatmulInputs(b, 1, eps, sm_count, tuning)  # the last row alone: the fused one-token GEMV
        launches += last.normed(weights.lm_head, hidden[rows - 1 :], weights.output_norm, b.logits)
    return launches
