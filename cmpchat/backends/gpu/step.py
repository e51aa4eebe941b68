"""One decode step of the whole model as a list of kernel launches, for a batch of up to 16 sequences.

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

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.backends.gpu.weights import AttentionWeights, DeviceMatrix, ModelWeights, RecurrentWeights
from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.attention import DecodeAttentionConfig, decode_attention, partial_buffer_shapes
from cmpchat.kernels.elementwise import embed_q8_0
from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, GatedDeltaNetWeights
from cmpchat.kernels.gated_deltanet import decode_step as gdn_decode_step
from cmpchat.kernels.gemm import gemm_q8_launch, matmul_kind
from cmpchat.kernels.gemv import gemv_q8_launch
from cmpchat.kernels.gemv_float import gemv_float_launch
from cmpchat.kernels.gemv_fused import gemv_q8_fused_launch
from cmpchat.kernels.qk_norm_rope import qk_norm_rope_launch, rope_tables
from cmpchat.kernels.quantize import quantize_launch, rms_norm_quantize_launch
from cmpchat.model.config import LayerKind, ModelConfig

if not SIMULATOR:
    from cuda.bindings import driver

MAX_ROWS = 16


@dataclass
class SequenceStates:
    """Per-slot state of every sequence the backend can hold: KV caches and GDN states."""

    k_cache: dict[int, Any]  # attention layer -> fp16 [slots, page_tokens, Hkv, hd]
    v_cache: dict[int, Any]
    conv_state: dict[int, Any]  # GDN layer -> fp32 [slots, K-1, conv_dim]
    delta_state: dict[int, Any]  # GDN layer -> fp32 [slots, Hv, dk, dv]
    slots: int
    page_tokens: int

    @classmethod
    def allocate(cls, config: ModelConfig, slots: int, page_tokens: int) -> SequenceStates:
        kv_shape = (slots, page_tokens, config.num_kv_heads, config.head_dim)
        conv_shape = (slots, config.conv_kernel - 1, config.conv_dim)
        delta_shape = (slots, config.num_v_heads, config.k_head_dim, config.v_head_dim)
        return cls(
            k_cache={i: cuda.device_array(kv_shape, np.float16) for i in config.attention_layers},
            v_cache={i: cuda.device_array(kv_shape, np.float16) for i in config.attention_layers},
            conv_state={i: zeros(conv_shape) for i in config.recurrent_layers},
            delta_state={i: zeros(delta_shape) for i in config.recurrent_layers},
            slots=slots,
            page_tokens=page_tokens,
        )

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's recurrent state (a KV cache needs no clearing: lengths say what is valid)."""
        for states in (self.conv_state, self.delta_state):
            for array in states.values():
                fill_zero(array[slot])

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Make `target` a copy of `source` whose first `length` cached tokens are valid (device to device)."""
        for caches in (self.k_cache, self.v_cache):
            for array in caches.values():
                if length:
                    array[target, :length].copy_to_device(array[source, :length])
        for states in (self.conv_state, self.delta_state):
            for array in states.values():
                array[target].copy_to_device(array[source])


def ordering_event() -> Any:
    """A CUDA event for waiting on (no timing, so recording it costs the least; the simulator's takes no
    options)."""
    return cuda.event() if SIMULATOR else cuda.event(timing=False)


@dataclass
class StepBuffers:
    """Device buffers of one decode step, sized for 16 rows; a step for B rows uses the first B.

    The step's integer inputs (tokens, positions, page_table, gdn_slots) are views of one int32 device
    array, `inputs`, at 64-byte offsets, so one asynchronous copy from pinned memory uploads them all:

        tokens, positions, pages, slots = buffers.stage()   # pinned host views, every row idle
        tokens[:rows] = ...                                  # fill the active rows
        buffers.upload(stream)                               # queued ahead of the step's launches

    Two pinned mirrors are used in turn, each guarded by an event recorded after its copy: `stage` waits
    until the copy that last read its mirror has run, which costs nothing once the step was synchronised
    (sampling does) and lets steps queued without waiting (prefill) keep one step ahead of the GPU.
    """

    tokens: Any  # int32 [16]                   } views of `inputs`
    positions: Any  # int32 [16, 4]: (cache index, t, h, w); negative cache index = idle row
    page_table: Any  # int32 [16, 1]: the KV slot of each row
    gdn_slots: Any  # int32 [16]: the recurrent-state slot of each row, -1 for idle rows
    hidden: Any  # fp32 [16, d]
    normalized: Any  # fp32 [16, d]
    x_quants: Any  # uint32 [16, d/4]
    x_scales: Any  # fp32 [16, d/32]
    projection: Any  # fp32 [16, widest fused projection]
    mixed: Any  # fp32 [16, max(H*hd, Hv*dv, ffn)]
    m_quants: Any
    m_scales: Any
    q: Any  # fp32 [16, H, hd]
    logits: Any  # fp32 [16, V]
    inv_freq: Any  # float64 [rope_dims/2]
    freq_axis: Any  # int32 [rope_dims/2]
    inputs: Any  # int32 [112] device: tokens | positions | page_table | gdn_slots
    staging: Any  # int32 [2, 112] pinned host mirrors of `inputs`, used in turn
    uploaded: list[Any]  # per mirror: a CUDA event recorded after the copy that last read it
    idle: np.ndarray = field(repr=False)  # int32 [112]: every row idle (token -1, position -1, page 0, slot -1)
    _views: list[tuple[np.ndarray, ...]] = field(repr=False)  # per mirror: its (tokens, ..., gdn_slots) views
    _pointers: tuple[int, ...] = field(repr=False)  # addresses of `inputs` and of each mirror (0 simulated)
    _turn: int = 0

    # (name, shape, value of an idle row) of each input, in the order they lie in `inputs`; every size is a
    # multiple of 16 int32s, so each view starts 64-byte aligned (the kernels only need 4).
    INPUTS = (("tokens", (MAX_ROWS,), -1), ("positions", (MAX_ROWS, 4), -1), ("page_table", (MAX_ROWS, 1), 0),
              ("gdn_slots", (MAX_ROWS,), -1))  # fmt: skip

    @staticmethod
    def input_views(flat: Any) -> tuple[Any, ...]:
        """(tokens, positions, page_table, gdn_slots) views of a flat int32 [112] array (host or device)."""
        views, start = [], 0
        for _, shape, _ in StepBuffers.INPUTS:
            size = int(np.prod(shape))
            views.append(flat[start : start + size].reshape(shape))
            start += size
        return tuple(views)

    def stage(self) -> tuple[np.ndarray, ...]:
        """Pinned host (tokens, positions, page_table, gdn_slots) for the next step, every row idle.

        Fill the active rows, then `upload`. Blocks only while a copy queued two uploads ago is pending."""
        turn = self._turn
        self.uploaded[turn].synchronize()
        np.copyto(self.staging[turn], self.idle)
        return self._views[turn]

    def upload(self, stream: Any, *, tokens_on_device: bool = False) -> None:
        """Queue the copy of the staged inputs to the device on `stream` (returns at once). With
        `tokens_on_device` the tokens are left as they are there (written by the GPU's token selection)."""
        turn = self._turn
        host = self.staging[turn]
        skip = MAX_ROWS if tokens_on_device else 0  # `tokens` lies first
        if SIMULATOR:
            self.inputs[skip:].copy_to_device(host[skip:], stream=stream)
        else:
            device, *mirrors = self._pointers
            offset = skip * host.itemsize
            result = driver.cuMemcpyHtoDAsync(
                device + offset, mirrors[turn] + offset, host.nbytes - offset, stream_handle(stream)
            )
            check("cuMemcpyHtoDAsync", result)
        self.uploaded[turn].record(stream)
        self._turn = (turn + 1) % len(self.uploaded)

    @classmethod
    def allocate(cls, config: ModelConfig) -> StepBuffers:
        d = config.hidden_size
        attention_width = 2 * (config.num_heads + config.num_kv_heads) * config.head_dim
        gdn_width = config.conv_dim + config.num_v_heads * config.v_head_dim + 2 * config.num_v_heads
        mixed_width = max(config.num_heads * config.head_dim, config.num_v_heads * config.v_head_dim, config.ffn_size)
        rope = rope_tables(config.rope_dims, config.rope_theta, config.rope_sections)
        idle = np.concatenate([np.full(int(np.prod(shape)), value, np.int32) for _, shape, value in cls.INPUTS])
        inputs = cuda.to_device(idle)
        staging = cuda.pinned_array((2, idle.size), np.int32)
        staging[:] = idle
        tokens, positions, page_table, gdn_slots = cls.input_views(inputs)
        pointers = (0,) * 3 if SIMULATOR else (inputs.device_ctypes_pointer.value, *(m.ctypes.data for m in staging))
        return cls(
            tokens=tokens,
            positions=positions,
            page_table=page_table,
            gdn_slots=gdn_slots,
            hidden=zeros((MAX_ROWS, d)),
            normalized=zeros((MAX_ROWS, d)),
            x_quants=zeros((MAX_ROWS, d // 4), np.uint32),
            x_scales=zeros((MAX_ROWS, d // 32)),
            projection=zeros((MAX_ROWS, max(attention_width, gdn_width, 2 * config.ffn_size))),
            mixed=zeros((MAX_ROWS, mixed_width)),
            m_quants=zeros((MAX_ROWS, mixed_width // 4), np.uint32),
            m_scales=zeros((MAX_ROWS, mixed_width // 32)),
            q=zeros((MAX_ROWS, config.num_heads, config.head_dim)),
            logits=zeros((MAX_ROWS, config.vocab_size)),
            inv_freq=cuda.to_device(rope.inv_freq),
            freq_axis=cuda.to_device(rope.freq_axis),
            inputs=inputs,
            staging=staging,
            # The simulator runs everything synchronously; its events take no timing flag and do nothing.
            uploaded=[ordering_event() for _ in staging],
            idle=idle,
            _views=[cls.input_views(mirror) for mirror in staging],
            _pointers=pointers,
        )


@dataclass
class AttentionSplits:
    """How decode attention is split for one batch-size bucket, with its partial-result scratch."""

    config: DecodeAttentionConfig
    partial_acc: Any
    partial_ml: Any

    @classmethod
    def allocate(cls, model: ModelConfig, rows: int, sm_count: int) -> AttentionSplits:
        config = DecodeAttentionConfig.splits_for(rows, model.num_heads, model.num_kv_heads, sm_count)
        acc_shape, ml_shape = partial_buffer_shapes(rows, model.num_heads, model.head_dim, config)
        return cls(config, zeros(acc_shape), zeros(ml_shape))


def decode_launches(
    config: ModelConfig,
    weights: ModelWeights,
    states: SequenceStates,
    buffers: StepBuffers,
    splits: AttentionSplits,
    rows: int,
    sm_count: int,
    *,
    tokens_per_sequence: int = 1,
) -> list[Launch]:
    """Every launch of one step for the first `rows` rows of the step buffers, in order: one token of each
    row's sequence, or (`tokens_per_sequence` = rows) consecutive tokens of one sequence, a prompt chunk:
    each row's K/V lands in the cache before attention reads it, so row i sees the prompt up to itself, and
    the Gated DeltaNet layers take the rows in order."""
    b = buffers
    hidden = b.hidden[:rows]
    launches = [embed_q8_0(b.tokens[:rows], weights.embedding.quants, weights.embedding.scales, hidden)]
    gdn_shape = GatedDeltaNetShape.from_config(config)
    inputs = MatmulInputs(b, rows, config.rms_eps, sm_count)
    for index, layer in enumerate(weights.layers):
        mixer = layer.mixer
        if isinstance(mixer, AttentionWeights):
            width = 2 * (config.num_heads + config.num_kv_heads) * config.head_dim
            projection = columns(b.projection, rows, width)
            launches += inputs.normed(mixer.qkv, hidden, layer.mixer_norm, projection)
            q = b.q[:rows]
            k_cache, v_cache = states.k_cache[index], states.v_cache[index]
            positions, pages = b.positions[:rows], b.page_table[:rows]
            launches.append(
                qk_norm_rope_launch(
                    projection,
                    positions,
                    pages,
                    mixer.q_norm,
                    mixer.k_norm,
                    b.inv_freq,
                    b.freq_axis,
                    config.rms_eps,
                    q,
                    k_cache,
                    v_cache,
                )
            )
            attended = columns(b.mixed, rows, config.num_heads * config.head_dim)
            launches += decode_attention(
                q,
                projection,
                positions,
                pages,
                k_cache,
                v_cache,
                splits.partial_acc,
                splits.partial_ml,
                attended,
                splits.config,
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
                states.conv_state[index],
                states.delta_state[index],
                b.gdn_slots[:rows],
                attended,
                tokens_per_sequence=tokens_per_sequence,
            )
        launches += inputs.project_into(mixer.output, attended, hidden)
        activated = columns(b.mixed, rows, config.ffn_size)
        launches += inputs.normed(layer.gate_up, hidden, layer.mlp_norm, activated, mode="swiglu")
        launches += inputs.project_into(layer.down, activated, hidden)
    launches += inputs.normed(weights.lm_head, hidden, weights.output_norm, b.logits[:rows])
    return launches


@dataclass(frozen=True)
class MatmulInputs:
    """How a step prepares each matmul's input: at one row a Q8_0 GEMV normalises and quantises it itself
    (`gemv_fused`); otherwise a launch writes the int8 (and fp32, for float weights) form first, and the
    batched GEMV (up to 16 rows) or the GEMM (more, `gemm.matmul_kind`) multiplies."""

    b: Any  # StepBuffers, or prompt_step.PromptBuffers: the same activation buffers
    rows: int
    eps: float
    sm_count: int

    def fused(self, matrix: DeviceMatrix) -> bool:
        return self.rows == 1 and matrix.is_q8_0

    def normed(self, matrix: DeviceMatrix, hidden: Any, norm: Any, out: Any, mode: str = "store") -> list[Launch]:
        """out (=, or SwiGLU) matrix @ RMSNorm(hidden) * norm."""
        if self.fused(matrix):
            return [
                gemv_q8_fused_launch(matrix.quants, matrix.scales, hidden, out, mode=mode, norm_weight=norm,
                                     eps=self.eps, sm_count=self.sm_count)
            ]  # fmt: skip
        b, rows = self.b, self.rows
        norm_launch = rms_norm_quantize_launch(
            hidden, norm, self.eps, b.x_quants[:rows], b.x_scales[:rows], b.normalized[:rows]
        )
        return [norm_launch, _matmul(matrix, b, rows, out, mode)]

    def project_into(self, matrix: DeviceMatrix, activations: Any, hidden: Any) -> list[Launch]:
        """hidden += matrix @ activations (the residual add fused into the GEMV)."""
        if self.fused(matrix):
            return [
                gemv_q8_fused_launch(matrix.quants, matrix.scales, activations, hidden, mode="accumulate",
                                     sm_count=self.sm_count)
            ]  # fmt: skip
        return _project_into(matrix, activations, self.b, self.rows, hidden)


def _matmul(matrix: DeviceMatrix, b: Any, rows: int, out: Any, mode: str = "store") -> Launch:
    """out (=, += or swiglu) matrix @ the normalised input (its int8 form for Q8_0 weights)."""
    if matrix.is_q8_0:
        return _q8_matmul(matrix, b.x_quants[:rows], b.x_scales[:rows], out, mode)
    return _float_matmul(matrix, b.normalized[:rows], out, mode)


def _project_into(matrix: DeviceMatrix, activations: Any, b: Any, rows: int, hidden: Any) -> list[Launch]:
    """hidden += matrix @ activations (the residual add fused into the GEMV)."""
    if not matrix.is_q8_0:
        return [_float_matmul(matrix, activations, hidden, "accumulate")]
    width = activations.shape[1]
    quants = columns(b.m_quants, rows, width // 4)
    scales = columns(b.m_scales, rows, width // 32)
    return [
        quantize_launch(activations, quants, scales),
        _q8_matmul(matrix, quants, scales, hidden, "accumulate"),
    ]


def _q8_matmul(matrix: DeviceMatrix, x_quants: Any, x_scales: Any, out: Any, mode: str) -> Launch:
    """out (=, += or swiglu) matrix @ int8 activations: the batched GEMV or the GEMM, by row count."""
    launch = gemm_q8_launch if matmul_kind(x_quants.shape[0]) == "gemm" else gemv_q8_launch
    return launch(matrix.quants, matrix.scales, x_quants, x_scales, out, mode=mode)


def _float_matmul(matrix: DeviceMatrix, x: Any, out: Any, mode: str) -> Launch:
    bf16 = matrix.tensor_type == GGMLQuantizationType.BF16
    weight = matrix.dense if matrix.tensor_type != GGMLQuantizationType.F16 else matrix.dense.view(np.float16)
    return gemv_float_launch(weight, x, out, mode=mode, bf16=bf16)


def columns(buffer: Any, rows: int, width: int) -> Any:
    """A contiguous [rows, width] view at the start of a [16, wider] buffer (rows of `width`, packed)."""
    flat = buffer.reshape(-1)
    return flat[: rows * width].reshape(rows, width)


def zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
    array = cuda.device_array(shape, dtype)
    fill_zero(array)
    return array


def fill_zero(array: Any) -> None:
    """Zero a contiguous device array on the device (no host-side buffer: states can be 100s of MB)."""
    if SIMULATOR:
        array[...] = 0
    else:
        from numba.cuda.cudadrv import driver

        driver.device_memset(array, 0, array.nbytes)
