"""The chunked GDN prefill's workspace, shape checks and launch list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.gated_deltanet import ROWS_PER_THREAD, GatedDeltaNetShape, GatedDeltaNetWeights
from cmpchat.kernels.gated_deltanet_chunked.common import (
    CHUNK_SIZES,
    COLUMN_TILE,
    CONV_TOKENS,
    DEFAULT_CHUNK,
    MAX_KEY_DIM,
    NORM_TOKENS,
    OUTPUT_COLUMNS,
    STATE_COLUMNS,
    TILE_ENTRIES,
)
from cmpchat.kernels.gated_deltanet_chunked.conv import gdn_prefill_conv
from cmpchat.kernels.gated_deltanet_chunked.norm import gdn_prefill_gated_norm
from cmpchat.kernels.gated_deltanet_chunked.output import gdn_chunk_output
from cmpchat.kernels.gated_deltanet_chunked.prepare import gdn_chunk_prepare
from cmpchat.kernels.gated_deltanet_chunked.sequential import gdn_prefill_sequential
from cmpchat.kernels.gated_deltanet_chunked.state import gdn_chunk_state


def num_chunks(tokens: int, chunk: int) -> int:
    return -(-tokens // chunk)


@dataclass(frozen=True, slots=True)
class ChunkWorkspace:
    """What the chunked path passes between its launches (fp32, device memory)."""

    w: Any
    """[Hv, T, dk]: the WY factor W = T diag(beta e^gamma) K of each chunk."""
    qk: Any
    """[Hv, chunks, C, C]: e^(gamma_i - gamma_j) q_i.k_j for j <= i, else 0."""
    states: Any
    """[chunks, Hv, dk, dv]: the state at each chunk's start (the state pass writes, the output kernel reads)."""
    decay: Any
    """[Hv, T, 2]: e^gamma_i (chunk start to token i) and e^(gamma_L - gamma_i) (token i to chunk end)."""

    @staticmethod
    def shapes(shape: GatedDeltaNetShape, tokens: int, chunk: int) -> tuple[tuple[int, ...], ...]:
        heads = shape.num_v_heads
        chunks = num_chunks(tokens, chunk)
        return (
            (heads, tokens, shape.k_head_dim),
            (heads, chunks, chunk, chunk),
            (chunks, heads, shape.k_head_dim, shape.v_head_dim),
            (heads, tokens, 2),
        )

    @classmethod
    def nbytes(cls, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK) -> int:
        return sum(4 * math.prod(dims) for dims in cls.shapes(shape, tokens, chunk))

    @classmethod
    def allocate(cls, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK) -> ChunkWorkspace:
        return cls(*(cuda.device_array(dims, np.float32) for dims in cls.shapes(shape, tokens, chunk)))

    @classmethod
    def from_buffer(
        cls, buffer: Any, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK
    ) -> ChunkWorkspace:
        """Views into one flat fp32 device buffer (allocated once for the longest prompt, shared by all
        layers) of at least `nbytes / 4` elements. Every view starts 16-byte aligned when the buffer does (the
        kernels' 16-byte accesses need that of w, qk and states: their sizes are multiples of 4 elements)."""
        (length,) = check_array(buffer, "buffer", np.float32, 1)
        views = []
        offset = 0
        for dims in cls.shapes(shape, tokens, chunk):
            size = math.prod(dims)
            if offset + size > length:
                raise ValueError(f"a workspace for {tokens} tokens needs {cls.nbytes(shape, tokens, chunk) // 4} "
                                 f"fp32 elements, the buffer has {length}")  # fmt: skip
            views.append(buffer[offset : offset + size].reshape(dims))
            offset += size
        return cls(*views)


def check_prefill_shape(shape: GatedDeltaNetShape, chunk: int) -> None:
    """Raise ValueError unless the prefill kernels can run this layer with this chunk length."""
    if shape.k_head_dim > MAX_KEY_DIM:
        raise ValueError(f"GDN prefill kernels take key heads up to {MAX_KEY_DIM}, got dk={shape.k_head_dim}")
    if shape.v_head_dim % COLUMN_TILE or shape.k_head_dim % ROWS_PER_THREAD:
        raise ValueError(f"GDN prefill kernels need dv a multiple of {COLUMN_TILE} and dk of {ROWS_PER_THREAD}, "
                         f"got dv={shape.v_head_dim}, dk={shape.k_head_dim}")  # fmt: skip
    if shape.k_head_dim & (shape.k_head_dim - 1):
        raise ValueError(f"GDN prefill kernels need dk a power of two, got dk={shape.k_head_dim}")
    if chunk not in CHUNK_SIZES:
        raise ValueError(f"chunk must be one of {CHUNK_SIZES}, got {chunk}")
    if shape.conv_kernel - 1 > CONV_TOKENS:
        raise ValueError(f"conv kernels wider than {CONV_TOKENS + 1} taps are not supported")


def prefill_launches(
    shape: GatedDeltaNetShape,
    weights: GatedDeltaNetWeights,
    projection: Any,
    conv_state: Any,
    delta_state: Any,
    slot: int,
    out: Any,
    *,
    chunk: int = DEFAULT_CHUNK,
    chunked: bool = True,
    mixed: Any = None,
    workspace: ChunkWorkspace | None = None,
) -> list[Launch]:
    """The launches that run the T = projection.shape[0] tokens of one prompt through one GDN layer.

    projection [T, P] fp32 (layout in `gated_deltanet`'s docstring; not modified), conv_state
    [S, K-1, conv_dim] and delta_state [S, Hv, dk, dv] fp32 (slot `slot` read and updated in place),
    out [T, Hv*dv] fp32. `mixed` [T, conv_dim] receives the conv's output (allocated when None; it must not be
    the projection). The chunked path (`chunked=True`, chunk length `chunk`) also needs a `ChunkWorkspace`
    for T tokens (allocated when None); `chunked=False` runs the recurrence token by token in one launch.
    Allocating here is for convenience: an engine passes preallocated buffers.
    """
    check_prefill_shape(shape, chunk)
    tokens, width = check_array(projection, "projection", np.float32, 2)
    if tokens == 0:
        raise ValueError("a prefill needs at least one token")
    if width != shape.projection_width:
        raise ValueError(f"projection must have {shape.projection_width} columns (qkv | z | b | a), got {width}")
    num_slots = check_array(conv_state, "conv_state", np.float32, 3)[0]
    check_array(conv_state, "conv_state", np.float32, 3, (num_slots, shape.conv_kernel - 1, shape.conv_dim))
    state_shape = (num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
    check_array(delta_state, "delta_state", np.float32, 4, state_shape)
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot} out of range 0..{num_slots - 1}")
    check_array(out, "out", np.float32, 2, (tokens, shape.output_width))
    if mixed is None:
        mixed = cuda.device_array((tokens, shape.conv_dim), np.float32)
    elif mixed is projection:
        raise ValueError("mixed must be a buffer of its own: a prompt's conv reads inputs other blocks would overwrite")
    check_array(mixed, "mixed", np.float32, 2, (tokens, shape.conv_dim))
    check_array(weights.conv_weight, "weights.conv_weight", np.float32, 2, (shape.conv_dim, shape.conv_kernel))
    check_array(weights.ssm_a, "weights.ssm_a", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.dt_bias, "weights.dt_bias", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.norm_weight, "weights.norm_weight", np.float32, 1, (shape.v_head_dim,))

    num_k_heads = np.int32(shape.num_k_heads)
    slot32 = np.int32(slot)
    conv = Launch(
        gdn_prefill_conv,
        grid=(2 * shape.num_k_heads + shape.num_v_heads, num_chunks(tokens, CONV_TOKENS)),
        block=(max(shape.k_head_dim, shape.v_head_dim),),
        args=(
            projection,
            weights.conv_weight,
            conv_state,
            mixed,
            slot32,
            num_k_heads,
            np.int32(shape.k_head_dim),
            np.int32(shape.v_head_dim),
            np.float32(shape.k_head_dim**-0.5),  # rounded as the reference rounds it
        ),
    )
    state_grid = (shape.num_v_heads, shape.v_head_dim // COLUMN_TILE)
    state_block = (COLUMN_TILE, shape.k_head_dim // ROWS_PER_THREAD)
    norm = Launch(
        gdn_prefill_gated_norm,
        grid=(shape.num_v_heads, num_chunks(tokens, NORM_TOKENS)),
        block=(shape.v_head_dim,),
        args=(projection, weights.norm_weight, out, np.float32(shape.rms_eps)),
    )
    if not chunked:
        sequential = Launch(
            gdn_prefill_sequential,
            grid=state_grid,
            block=state_block,
            args=(projection, mixed, weights.ssm_a, weights.dt_bias, delta_state, out, slot32, num_k_heads),
        )
        return [conv, sequential, norm]

    if workspace is None:
        workspace = ChunkWorkspace.allocate(shape, tokens, chunk)
    w_shape, qk_shape, states_shape, decay_shape = ChunkWorkspace.shapes(shape, tokens, chunk)
    check_array(workspace.w, "workspace.w", np.float32, 3, w_shape)
    check_array(workspace.qk, "workspace.qk", np.float32, 4, qk_shape)
    check_array(workspace.states, "workspace.states", np.float32, 4, states_shape)
    check_array(workspace.decay, "workspace.decay", np.float32, 3, decay_shape)
    chunk32 = np.int32(chunk)
    chunks = num_chunks(tokens, chunk)
    flat_mixed, flat_w, flat_out = mixed.reshape(-1), workspace.w.reshape(-1), out.reshape(-1)
    flat_states = workspace.states.reshape(-1)
    prepare = Launch(
        gdn_chunk_prepare,
        grid=(chunks, shape.num_v_heads),
        block=((chunk // TILE_ENTRIES) ** 2,),
        args=(
            projection,
            flat_mixed,
            weights.ssm_a,
            weights.dt_bias,
            flat_w,
            workspace.qk,
            workspace.decay,
            flat_out,
            num_k_heads,
            chunk32,
        ),
    )
    state = Launch(
        gdn_chunk_state,
        grid=(shape.num_v_heads, shape.v_head_dim // STATE_COLUMNS),
        block=(max(2 * chunk, shape.k_head_dim),),
        args=(flat_mixed, flat_w, workspace.decay, flat_out, flat_states, delta_state, slot32, num_k_heads, chunk32),
    )
    output = Launch(
        gdn_chunk_output,
        grid=(shape.v_head_dim // OUTPUT_COLUMNS, shape.num_v_heads, chunks),
        block=(2 * chunk,),
        args=(
            flat_mixed,
            workspace.qk.reshape(-1),
            workspace.decay,
            flat_states,
            flat_out,
            num_k_heads,
            np.int32(shape.k_head_dim),
            np.int32(shape.v_head_dim),
            chunk32,
        ),
    )
    return [conv, prepare, state, output, norm]
