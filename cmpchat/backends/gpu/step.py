"""One decode step of a stage's layers as a list of kernel launches, for a batch of up to 16 sequences.

The launches read everything that changes per token (token ids, positions, cache indices, state slots)
from device buffers, so the list is built once per batch-size bucket and captured as a CUDA graph.
Layer by layer (matching the reference backend in GPU-mirroring mode):

    x = embed(tokens)
    per layer:  h = rms_norm_quantize(x)   (inside the GEMV's prologue at one row: gemv_fused)
                attention:  p = W_qkv h;  q, K/V cache = qk_norm_rope(p);  a = attention(q, cache) * sigmoid(gate)
                GDN:        p = W_qkv|z|b|a h;  a = gated_deltanet_step(p, states)
                x += W_out quantize(a)
                x += W_down quantize(swiglu(W_gate|up rms_norm_quantize(x)))
    logits = W_lm rms_norm_quantize(x)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.backends.gpu.buffers import columns, ordering_event, zeros
from cmpchat.backends.gpu.kv_layout import FP16, KvPages
from cmpchat.backends.gpu.states import RecurrentStates
from cmpchat.backends.gpu.weights import AttentionWeights, DeviceMatrix, RecurrentWeights, StageWeights
from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.attention import DecodeAttentionConfig, decode_attention, partial_buffer_shapes
from cmpchat.kernels.attention_compressed import compressed_decode_attention
from cmpchat.kernels.device_table import DeviceTuning
from cmpchat.kernels.elementwise import embed_q8_0
from cmpchat.kernels.embed_kquant import embed_kquant
from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, GatedDeltaNetWeights
from cmpchat.kernels.gated_deltanet import decode_step as gdn_decode_step
from cmpchat.kernels.gemm import gemm_kquant_launch, gemm_q8_launch, matmul_kind
from cmpchat.kernels.gemv import gemv_q8_launch
from cmpchat.kernels.gemv_float import gemv_float_launch
from cmpchat.kernels.gemv_fused import gemv_kquant_fused_launch, gemv_q8_fused_launch
from cmpchat.kernels.gemv_kquant import kquant_matmul_launch
from cmpchat.kernels.kv_write import kv_write_launch
from cmpchat.kernels.qk_norm_rope import qk_norm_rope_launch, qk_norm_rope_rows_launch, rope_tables
from cmpchat.kernels.quantize import quantize_launch, rms_norm_quantize_launch
from cmpchat.model.config import LayerKind, ModelConfig

if not SIMULATOR:
    from cuda.bindings import driver

MAX_ROWS = 16


class StepInputs:
    """The integer inputs of a step of `rows` rows as views of one int32 device array, at 64-byte offsets:

        tokens [rows] | positions [rows, 4]: (cache index, t, h, w) | gdn_slots [rows] | page_table [rows, P]

    A negative cache index or state slot marks an idle row. Two pinned host mirrors are used in turn, each
    guarded by an event recorded after its copy, so a step queued without waiting (prefill) keeps one step ahead
    of the GPU. Each upload sends the first three and only the page-table rows that changed since the device
    last got them: at 256K tokens a row is 1024 entries, which a Gen1 x1 link would take 16 µs to move.
    """

    def __init__(self, rows: int, pages_per_row: int) -> None:
        self.rows = rows
        self.pages_per_row = pages_per_row
        sizes = (rows, 4 * rows, rows, rows * pages_per_row)
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + -(-size // 16) * 16)
        self.device = cuda.device_array(self._offsets[-1], np.int32)
        self.staging = cuda.pinned_array((2, self._offsets[-1]), np.int32)
        self.tokens, self.positions, self.gdn_slots, self.page_table = self.views(self.device)
        self._mirrors = [self.views(mirror) for mirror in self.staging]
        self._uploaded = [ordering_event() for _ in self.staging]
        self._known = np.zeros((rows, pages_per_row), np.int32)
        """The page table the device holds (rows that `_valid` marks)."""
        self._valid = np.zeros(rows, bool)
        self._pointers = (0,) * 3 if SIMULATOR else (self.device.device_ctypes_pointer.value,
                                                     *(m.ctypes.data for m in self.staging))  # fmt: skip
        self._turn = 0
        self.staging[:] = 0
        for views in self._mirrors:
            self._idle(views)
        self.device.copy_to_device(self.staging[0])

    def views(self, flat: Any) -> tuple[Any, Any, Any, Any]:
        o, rows = self._offsets, self.rows
        return (
            flat[o[0] : o[0] + rows],
            flat[o[1] : o[1] + 4 * rows].reshape(rows, 4),
            flat[o[2] : o[2] + rows],
            flat[o[3] : o[3] + rows * self.pages_per_row].reshape(rows, self.pages_per_row),
        )

    @staticmethod
    def _idle(views: tuple[Any, ...]) -> None:
        tokens, positions, gdn_slots, _ = views
        tokens[:] = -1
        positions[:] = -1
        gdn_slots[:] = -1

    def stage(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pinned host (tokens, positions, gdn_slots) for the next step, every row idle. Fill the active rows,
        then `upload`. Blocks only while a copy queued two uploads ago is pending."""
        turn = self._turn
        self._uploaded[turn].synchronize()
        views = self._mirrors[turn]
        self._idle(views)
        return views[0], views[1], views[2]

    def upload(self, stream: Any, pages: Sequence[Sequence[int]], *, tokens_on_device: bool = False) -> None:
        """Queue the copy of the staged inputs and of the page-table rows that differ from `pages` (row r of
        the step holds the pages of `pages[r]`); with `tokens_on_device` the tokens are left as they are on
        the device (written there by the GPU's token selection)."""
        turn = self._turn
        changed = []
        for row, row_pages in enumerate(pages):
            count = len(row_pages)
            if count > self.pages_per_row:
                raise ValueError(f"{count} pages exceed the {self.pages_per_row} a step's page table holds")
            if not self._valid[row] or not np.array_equal(self._known[row, :count], row_pages):
                self._known[row, :count] = row_pages
                self._valid[row] = True
                changed.append(row)
        skip = self._offsets[1] if tokens_on_device else 0
        self._copy(turn, skip, self._offsets[3], stream)
        if changed:
            first, last = min(changed), max(changed) + 1
            # The whole span goes up from this mirror, so it gets the rows in between too (the other mirror may
            # have carried their last change).
            self._mirrors[turn][3][first:last] = self._known[first:last]
            start = self._offsets[3] + first * self.pages_per_row
            self._copy(turn, start, self._offsets[3] + last * self.pages_per_row, stream)
        self._uploaded[turn].record(stream)
        self._turn = (turn + 1) % len(self._uploaded)

    def _copy(self, turn: int, start: int, stop: int, stream: Any) -> None:
        host = self.staging[turn]
        if SIMULATOR:
            self.device[start:stop].copy_to_device(host[start:stop], stream=stream)
            return
        device, *mirrors = self._pointers
        offset = start * host.itemsize
        result = driver.cuMemcpyHtoDAsync(
            device + offset, mirrors[turn] + offset, (stop - start) * host.itemsize, stream_handle(stream)
        )
        check("cuMemcpyHtoDAsync", result)


@dataclass
class StepBuffers:
    """Device buffers of one decode step, sized for 16 rows; a step for B rows uses the first B."""

    inputs: StepInputs
    hidden: Any  # fp32 [16, d]
    normalized: Any  # fp32 [16, d]
    x_quants: Any  # uint32 [16, d/4]
    x_scales: Any  # fp32 [16, d/32]
    projection: Any  # fp32 [16, widest fused projection]
    mixed: Any  # fp32 [16, max(H*hd, Hv*dv, ffn)]
    m_quants: Any
    m_scales: Any
    q: Any  # fp32 [16, H, hd]
    k_rows: Any  # fp32 [16, Hkv, hd]: the new keys on their way into a compressed cache (`kv_write`)
    logits: Any  # fp32 [16, V]
    inv_freq: Any  # float64 [rope_dims/2]
    freq_axis: Any  # int32 [rope_dims/2]

    @property
    def tokens(self) -> Any:
        return self.inputs.tokens

    @property
    def positions(self) -> Any:
        return self.inputs.positions

    @property
    def page_table(self) -> Any:
        return self.inputs.page_table

    @property
    def gdn_slots(self) -> Any:
        return self.inputs.gdn_slots

    @staticmethod
    def page_table_bytes(pages_per_row: int) -> int:
        """Device and pinned host bytes of the page tables, per page a row holds."""
        return 3 * MAX_ROWS * 4 * pages_per_row

    @classmethod
    def allocate(cls, config: ModelConfig, pages_per_row: int) -> StepBuffers:
        d = config.hidden_size
        attention_width = 2 * (config.num_heads + config.num_kv_heads) * config.head_dim
        gdn_width = config.conv_dim + config.num_v_heads * config.v_head_dim + 2 * config.num_v_heads
        mixed_width = max(config.num_heads * config.head_dim, config.num_v_heads * config.v_head_dim, config.ffn_size)
        rope = rope_tables(config.rope_dims, config.rope_theta, config.rope_sections)
        return cls(
            inputs=StepInputs(MAX_ROWS, pages_per_row),
            hidden=zeros((MAX_ROWS, d)),
            normalized=zeros((MAX_ROWS, d)),
            x_quants=zeros((MAX_ROWS, d // 4), np.uint32),
            x_scales=zeros((MAX_ROWS, d // 32)),
            projection=zeros((MAX_ROWS, max(attention_width, gdn_width, 2 * config.ffn_size))),
            mixed=zeros((MAX_ROWS, mixed_width)),
            m_quants=zeros((MAX_ROWS, mixed_width // 4), np.uint32),
            m_scales=zeros((MAX_ROWS, mixed_width // 32)),
            q=zeros((MAX_ROWS, config.num_heads, config.head_dim)),
            k_rows=zeros((MAX_ROWS, config.num_kv_heads, config.head_dim)),
            logits=zeros((MAX_ROWS, config.vocab_size)),
            inv_freq=cuda.to_device(rope.inv_freq),
            freq_axis=cuda.to_device(rope.freq_axis),
        )


@dataclass
class AttentionSplits:
    """How decode attention is split for one batch-size bucket, with its partial-result scratch."""

    config: DecodeAttentionConfig
    partial_acc: Any
    partial_ml: Any

    @classmethod
    def allocate(cls, model: ModelConfig, rows: int, sm_count: int, tuning: DeviceTuning) -> AttentionSplits:
        config = tuning.decode_attention_config(rows, model.num_heads, model.num_kv_heads, sm_count)
        acc_shape, ml_shape = partial_buffer_shapes(rows, model.num_heads, model.head_dim, config)
        return cls(config, zeros(acc_shape), zeros(ml_shape))


def decode_launches(
    config: ModelConfig,
    weights: StageWeights,
    kv: KvPages,
    states: RecurrentStates,
    buffers: StepBuffers,
    splits: AttentionSplits,
    rows: int,
    sm_count: int,
    tuning: DeviceTuning,
    *,
    tokens_per_sequence: int = 1,
) -> list[Launch]:
    """Every launch of one step of a stage's layers for the first `rows` rows of the step buffers, in order:
    one token of each row's sequence, or (`tokens_per_sequence` = rows) consecutive tokens of one sequence, a
    prompt chunk: each row's K/V lands in the cache before attention reads it, so row i sees the prompt up to
    itself, and the Gated DeltaNet layers take the rows in order. The first stage embeds the tokens; the last
    turns the hidden states into logits. Grids are sized for `sm_count` SMs, tilings are `tuning`'s."""
    b = buffers
    hidden = b.hidden[:rows]
    launches = []
    if weights.embedding is not None:
        launches.append(embed_launch(weights.embedding, b.tokens[:rows], hidden))
    gdn_shape = GatedDeltaNetShape.from_config(config)
    inputs = MatmulInputs(b, rows, config.rms_eps, sm_count, tuning)
    for index, layer in weights.layers.items():
        mixer = layer.mixer
        if isinstance(mixer, AttentionWeights):
            width = 2 * (config.num_heads + config.num_kv_heads) * config.head_dim
            projection = columns(b.projection, rows, width)
            launches += inputs.normed(mixer.qkv, hidden, layer.mixer_norm, projection)
            q = b.q[:rows]
            caches = kv.caches(index)
            positions, pages = b.positions[:rows], b.page_table[:rows]
            tables = (mixer.q_norm, mixer.k_norm, b.inv_freq, b.freq_axis, config.rms_eps)
            attended = columns(b.mixed, rows, config.num_heads * config.head_dim)
            split_args = (splits.partial_acc, splits.partial_ml, attended, splits.config)
            if kv.format_name == FP16.name:
                k_cache, v_cache = caches
                launches.append(qk_norm_rope_launch(projection, positions, pages, *tables, q, k_cache, v_cache))
                launches += decode_attention(q, projection, positions, pages, k_cache, v_cache, *split_args)
            else:
                k_rows = b.k_rows[:rows]
                launches.append(qk_norm_rope_rows_launch(projection, positions, *tables, q, k_rows))
                launches.append(kv_write_launch(k_rows, projection, positions, pages, caches, kv.format_name))
                launches += compressed_decode_attention(
                    q, projection, positions, pages, caches, kv.format_name, *split_args
                )
        else:
            assert isinstance(mixer, RecurrentWeights) and layer.kind is LayerKind.RECURRENT
            projection = columns(b.projection, rows, mixer.projection.rows)
            launches += inputs.normed(mixer.projection, hidden, layer.mixer_norm, projection)
            attended = columns(b.mixed, rows, config.num_v_heads * config.v_head_dim)
            gdn_weights = GatedDeltaNetWeights(mixer.conv_weight, mixer.ssm_a, mixer.dt_bias, mixer.norm_weight)
            launches += gdn_decode_step(
                gdn_shape,
                gdn_weights,
                projection,
                states.conv[index],
                states.delta[index],
                b.gdn_slots[:rows],
                attended,
                tokens_per_sequence=tokens_per_sequence,
            )
        launches += inputs.project_into(mixer.output, attended, hidden)
        activated = columns(b.mixed, rows, config.ffn_size)
        launches += inputs.normed(layer.gate_up, hidden, layer.mlp_norm, activated, mode="swiglu")
        launches += inputs.project_into(layer.down, activated, hidden)
    if weights.lm_head is not None:
        launches += inputs.normed(weights.lm_head, hidden, weights.output_norm, b.logits[:rows])
    return launches


@dataclass(frozen=True)
class MatmulInputs:
    """How a step prepares each matmul's input: at one row a Q8_0 or 4/5/6-bit GEMV normalises and quantises it
    itself (`gemv_fused`); otherwise a launch writes the int8 (and fp32, for float weights) form first, and the
    batched GEMV (up to 16 rows) or the GEMM (more, `gemm.matmul_kind`) multiplies, tiled as `tuning` says for
    `sm_count` SMs; 4/5/6-bit weights likewise (`gemv_kquant`, `gemm.gemm_kquant_launch`), a launch per part
    of a matrix whose parts differ in type."""

    b: Any  # StepBuffers, or prompt_step.PromptBuffers: the same activation buffers
    rows: int
    eps: float
    sm_count: int
    tuning: DeviceTuning

    def fused_launches(
        self, matrix: DeviceMatrix, x: Any, out: Any, mode: str, norm: Any | None = None, eps: float = 0.0
    ) -> list[Launch]:
        """The one-token fused GEMV of `matrix` on x (normalised with `norm` when given), in the row's tiling: one
        launch, or one a part of a matrix whose parts differ in type (each prepares the input itself)."""
        if matrix.is_q8_0:
            tiling = self.tuning.gemv_tiling(matrix.rows, matrix.cols, mode, self.sm_count)
            return [gemv_q8_fused_launch(matrix.quants, matrix.scales, x, out, mode=mode, norm_weight=norm, eps=eps,
                                         sm_count=self.sm_count, tiling=tiling)]  # fmt: skip
        launches, first = [], 0
        for part in matrix.parts or (matrix,):
            assert part.tensor_type is not None and part.kquant is not None
            tiling = self.tuning.gemv_tiling(part.rows, part.cols, mode, self.sm_count)
            launches.append(
                gemv_kquant_fused_launch(part.tensor_type, part.kquant, part.cols, x, out, mode=mode, norm_weight=norm,
                                         eps=eps, out_first=first, sm_count=self.sm_count, tiling=tiling)
            )  # fmt: skip
            first += part.rows
        return launches

    def fused(self, matrix: DeviceMatrix) -> bool:
        return self.rows == 1 and takes_int8(matrix)

    def normed(self, matrix: DeviceMatrix, hidden: Any, norm: Any, out: Any, mode: str = "store") -> list[Launch]:
        """out (=, or SwiGLU) matrix @ RMSNorm(hidden) * norm."""
        if self.fused(matrix):
            return self.fused_launches(matrix, hidden, out, mode, norm, self.eps)
        b, rows = self.b, self.rows
        norm_launch = rms_norm_quantize_launch(
            hidden, norm, self.eps, b.x_quants[:rows], b.x_scales[:rows], b.normalized[:rows]
        )
        return [norm_launch, *_matmul(matrix, b, rows, out, mode, self.tuning)]

    def project_into(self, matrix: DeviceMatrix, activations: Any, hidden: Any) -> list[Launch]:
        """hidden += matrix @ activations (the residual add fused into the GEMV)."""
        if self.fused(matrix):
            return self.fused_launches(matrix, activations, hidden, "accumulate")
        return _project_into(matrix, activations, self.b, self.rows, hidden, self.tuning)


def embed_launch(embedding: DeviceMatrix, tokens: Any, hidden: Any) -> Launch:
    """hidden[t] = the embedding's row tokens[t] (Q8_0 or a 4/5/6-bit type: `check_gpu_types`)."""
    if embedding.kquant is not None:
        assert embedding.tensor_type is not None
        return embed_kquant(embedding.tensor_type, tokens, embedding.kquant, hidden)
    return embed_q8_0(tokens, embedding.quants, embedding.scales, hidden)


def _matmul(matrix: DeviceMatrix, b: Any, rows: int, out: Any, mode: str, tuning: DeviceTuning) -> list[Launch]:
    """out (=, += or swiglu) matrix @ the normalised input (its int8 form for quantised weights)."""
    if takes_int8(matrix):
        return _int8_matmul(matrix, b.x_quants[:rows], b.x_scales[:rows], out, mode, tuning)
    return [_float_matmul(matrix, b.normalized[:rows], out, mode)]


def _project_into(
    matrix: DeviceMatrix, activations: Any, b: Any, rows: int, hidden: Any, tuning: DeviceTuning
) -> list[Launch]:
    """hidden += matrix @ activations (the residual add fused into the GEMV)."""
    if not takes_int8(matrix):
        return [_float_matmul(matrix, activations, hidden, "accumulate")]
    width = activations.shape[1]
    quants = columns(b.m_quants, rows, width // 4)
    scales = columns(b.m_scales, rows, width // 32)
    return [
        quantize_launch(activations, quants, scales),
        *_int8_matmul(matrix, quants, scales, hidden, "accumulate", tuning),
    ]


def takes_int8(matrix: DeviceMatrix) -> bool:
    """Whether the matrix multiplies int8 activations: Q8_0, the 4/5/6-bit types, parts of those."""
    return matrix.is_q8_0 or matrix.kquant is not None or bool(matrix.parts)


def _int8_matmul(
    matrix: DeviceMatrix, x_quants: Any, x_scales: Any, out: Any, mode: str, tuning: DeviceTuning
) -> list[Launch]:
    """out (=, += or swiglu) matrix @ int8 activations; a matrix of parts takes a launch a part, each into its
    columns of out (parts are never a SwiGLU gate|up: `weights.upload_matrix`)."""
    if matrix.is_q8_0:
        return [_q8_matmul(matrix, x_quants, x_scales, out, mode, tuning)]
    parts = matrix.parts or (matrix,)
    gemm = matmul_kind(x_quants.shape[0]) == "gemm"
    launches, first = [], 0
    for part in parts:
        assert part.tensor_type is not None and part.kquant is not None
        args = (part.tensor_type, part.kquant, part.cols, x_quants, x_scales, out)
        if gemm:
            launches.append(gemm_kquant_launch(*args, mode=mode, out_first=first, tiling=tuning.gemm))
        else:
            launches.append(kquant_matmul_launch(*args, mode=mode, out_first=first))
        first += part.rows
    return launches


def _q8_matmul(matrix: DeviceMatrix, x_quants: Any, x_scales: Any, out: Any, mode: str, tuning: DeviceTuning) -> Launch:
    """out (=, += or swiglu) matrix @ int8 activations: the batched GEMV or the GEMM (in the row's tiling), by
    row count."""
    if matmul_kind(x_quants.shape[0]) == "gemm":
        return gemm_q8_launch(matrix.quants, matrix.scales, x_quants, x_scales, out, mode=mode, tiling=tuning.gemm)
    return gemv_q8_launch(matrix.quants, matrix.scales, x_quants, x_scales, out, mode=mode)


def _float_matmul(matrix: DeviceMatrix, x: Any, out: Any, mode: str) -> Launch:
    bf16 = matrix.tensor_type == GGMLQuantizationType.BF16
    weight = matrix.dense if matrix.tensor_type != GGMLQuantizationType.F16 else matrix.dense.view(np.float16)
    return gemv_float_launch(weight, x, out, mode=mode, bf16=bf16)
