"""Gated DeltaNet step in two launches (docs/model.md, "Gated DeltaNet layer"): one token for each of B sequences
(decode), or n consecutive tokens of each of B/n sequences taken in order within the launches (a prompt
chunk: `tokens_per_sequence`).

Input: the fp32 output of the fused input projection, one row per sequence,
`projection [B, P]`, P = conv_dim + Hv*dv + 2*Hv, columns
    [ q: Hk*dk | k: Hk*dk | v: Hv*dv ]  (= qkv, conv_dim channels, raw, before the conv)
    [ z: Hv*dv ]                        (output gate, head-major)
    [ b: Hv ]                           (beta logits)
    [ a: Hv ]                           (alpha logits)
i.e. the rows of attn_qkv, attn_gate, ssm_beta, ssm_alpha stacked in that order into one weight.

State, per GDN layer, in slots (any number; `slots[B] int32`, in device memory, maps batch row -> slot; a
negative slot marks an idle row whose output is zeroed and whose state is untouched, so one captured graph
serves any set of active sequences; a slot must not appear twice in one step):
    conv_state  [S, K-1, conv_dim] fp32  the last K-1 raw qkv inputs, oldest first (RecurrentState.conv)
    delta_state [S, Hv, dk, dv]    fp32  S_h, row index = key dim (RecurrentState.delta)
Both are updated in place. Output: `out [B, Hv*dv]` fp32 = RMSNorm(o_h) * ssm_norm.weight * silu(z_h),
heads concatenated: the input of ssm_out's activation quantisation.

Why two launches: the q/k channels of key head kh are read by every value head h with h % Hk == kh, so a
kernel with one block per value head could not also shift their conv state in place without a grid-wide
ordering. Launch 1 (`gdn_conv_step`, grid (2Hk+Hv, B/n), one thread per channel) does the conv, SiLU, the
state shift and the q/k L2 normalisation, writing the mixed q|k|v back over the projection's qkv columns
(same thread reads then writes the same element, so in place is safe) or into a separate buffer.
Launch 2 (`gdn_recurrent_step`, grid (Hv, B/n)) streams the fp32 state: block (dv, dk/ROWS_PER_THREAD),
thread (j, g) owns column j of S_h for rows g*ROWS_PER_THREAD .. +ROWS_PER_THREAD-1 in registers, so S is
read once and written once; a warp reads 32 consecutive columns of one row (128 contiguous bytes). The
two reductions over rows (u = S'ᵀk, o = Sᵀq) go through shared memory, the RMSNorm over columns through
warp sums.

One launch was measured and not kept (H200, 2026-12-01, CUDA-graph replays): each recurrence block ran the
conv of its own q, k and v channels from a shared-memory copy of their history, and the last block of a key
head to finish, counted with an atomic, wrote the q/k history back. Same bits; no faster at one sequence
(9B 10.45 against 10.35 µs), 25% slower at 16 and 8% at prompt chunks: the conv, the q/k norms and the
write-back's fence and barriers run in series with the recurrence in every block, and cost more than the
launch they save (a launch in a graph costs ~1 µs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    MAX_BLOCK_THREADS,
    WARP_SIZE,
    allow_dependent_grids,
    block_sum_f32,
    sum_in_order,
    wait_for_prior_grids,
    warp_sum_f32,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.elementwise import sigmoid, silu, softplus

if TYPE_CHECKING:
    from cmpchat.model.config import ModelConfig

ROWS_PER_THREAD = 16
"""State rows (key dims) each thread of the recurrent kernel keeps in registers; dk=128 -> 1024 threads."""
MAX_HEAD_DIM = 256
MAX_HEAD_WARPS = MAX_HEAD_DIM // WARP_SIZE  # a plain constant: Numba needs literal shared-array sizes
L2_NORM_EPS = float32(1e-6)  # the reference's L2_NORM_EPS
_ZERO = float32(0.0)
_ONE = float32(1.0)

_CONV_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[:, :, ::1], int32[::1], float32[:, ::1], "
    "int32, int32, int32, float32, int32)"
)
_RECURRENT_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[::1], "
    "float32[::1], int32[::1], float32[:, ::1], int32, float32, int32)"
)


# -- device helpers ----------------------------------------------------------------------------------


# -- kernels -----------------------------------------------------------------------------------------


@kernel(_CONV_SIGNATURE, early_launch=True)
def gdn_conv_step(
    projection, conv_weight, conv_state, slots, mixed, num_k_heads, k_head_dim, v_head_dim, q_scale, tokens_per_sequence
):
    """Block (head, sequence): heads 0..Hk-1 are q, Hk..2Hk-1 are k, then Hv value heads; thread = channel.
    The sequence's rows (`tokens_per_sequence` consecutive rows, in token order) are taken one after another.

    mixed[row, ch] = silu(causal conv) for ch < conv_dim, q/k then L2-normalised per head and q scaled.
    `mixed` may be `projection` itself (each element is read and written by the same thread).
    """
    wait_for_prior_grids()
    allow_dependent_grids()
    lane = cuda.threadIdx.x
    head = cuda.blockIdx.x
    qk_heads = 2 * num_k_heads
    if head < qk_heads:
        width = k_head_dim
        channel = head * k_head_dim + lane
    else:
        width = v_head_dim
        channel = qk_heads * k_head_dim + (head - qk_heads) * v_head_dim + lane
    taps = conv_weight.shape[1]
    for token in range(tokens_per_sequence):
        row = cuda.blockIdx.y * tokens_per_sequence + token
        slot = slots[row]
        if slot < 0:
            continue  # idle row (uniform over the block, so no barrier is skipped by part of it)
        value = _ZERO
        if lane < width:
            current = projection[row, channel]
            total = _ZERO
            # Tap 0 is the oldest input, tap K-1 the current one (summed in the reference's order). The shift
            # of the carried history happens as it is read: this thread alone owns the channel.
            for tap in range(taps - 1):
                past = conv_state[slot, tap, channel]
                total += past * conv_weight[channel, tap]
                if tap > 0:
                    conv_state[slot, tap - 1, channel] = past
            total += current * conv_weight[channel, taps - 1]
            conv_state[slot, taps - 2, channel] = current
            value = silu(total)
        if head < qk_heads:  # uniform over the block
            squares = block_sum_f32(value * value)
            value = value / float32(math.sqrt(squares + L2_NORM_EPS))
            if head < num_k_heads:
                value *= q_scale
        if lane < width:
            mixed[row, channel] = value


def _make_recurrent_step(prompt: bool) -> Any:
    """The recurrent kernel for one token per sequence (decode) or for a sequence's rows in turn (`prompt`:
    the state stays in registers from the first row to the last). Two compiled kernels, so decode keeps
    the single-token code that fits the 64 registers 1024 threads allow.

    Shared-memory and state indices are unsigned and counted with `while` loops: with Numba's signed
    indices and `range` every access carried a negative-index fix-up and 64-bit loop bookkeeping, which made
    the decode kernel issue-bound: 1,537 instructions a warp, 12.0 µs for the 9B shape's 32 heads on an H200,
    7.5 µs without them (27B: 12.3 -> 7.9 µs; batch 16: 48.8 -> 31.3 and 72.3 -> 45.9 µs)."""

    def recurrent_step(
        projection,
        mixed,
        ssm_a,
        dt_bias,
        norm_weight,
        delta_state,
        slots,
        out,
        num_k_heads,
        rms_eps,
        tokens_per_sequence,
    ):
        """Block (value head h, sequence), threads (column j, row group g): the delta rule on S_h, then the
        gated norm, for each of the sequence's rows in turn. `delta_state` is the flat [S * Hv * dk * dv]."""
        wait_for_prior_grids()
        allow_dependent_grids()
        column = cuda.threadIdx.x
        group = cuda.threadIdx.y
        head = cuda.blockIdx.x
        rows = tokens_per_sequence if prompt else 1
        first = cuda.blockIdx.y * rows
        num_v_heads = cuda.gridDim.x
        v_dim = cuda.blockDim.x
        groups = uint32(cuda.blockDim.y)
        k_dim = cuda.blockDim.y * ROWS_PER_THREAD

        q_shared = cuda.shared.array(MAX_HEAD_DIM, float32)
        k_shared = cuda.shared.array(MAX_HEAD_DIM, float32)
        v_shared = cuda.shared.array(MAX_HEAD_DIM, float32)
        z_shared = cuda.shared.array(MAX_HEAD_DIM, float32)
        u_partial = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        o_partial = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        norm_partial = cuda.shared.array(MAX_HEAD_WARPS, float32)
        thread_index = column + v_dim * group
        thread = uint64(thread_index)
        first_row = uint64(group * ROWS_PER_THREAD)
        row_stride = uint64(v_dim)

        # Issue the state loads first: they are the whole cost of a decode step, everything else hides behind
        # them. Every live row of a sequence carries the sequence's slot. Row m of this thread's rows is at
        # base + m * dv.
        slot = slots[first]
        state = cuda.local.array(ROWS_PER_THREAD, float32)
        base = uint64(((max(slot, 0) * num_v_heads + head) * k_dim + group * ROWS_PER_THREAD) * v_dim + column)
        if slot >= 0:
            for m in range(ROWS_PER_THREAD):
                state[m] = delta_state[base + uint64(m) * row_stride]

        # The per-head vectors go through shared memory rather than registers: with 1024 threads a thread has
        # 64 registers, and the 16 state values must stay in them.
        key_head = head % num_k_heads  # GGUF order: value head h reads key head h % Hk
        conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
        for token in range(rows):
            row = first + token
            if slots[row] < 0:
                if group == 0:
                    out[row, head * v_dim + column] = _ZERO  # downstream quantisation must not see stale rows
                continue
            if token > 0:
                cuda.syncthreads()  # the previous row is done with the shared vectors
            if thread_index < k_dim:
                q_shared[thread] = mixed[row, key_head * k_dim + thread_index]
                k_shared[thread] = mixed[row, (num_k_heads + key_head) * k_dim + thread_index]
            if group == 0:
                v_shared[column] = mixed[row, 2 * num_k_heads * k_dim + head * v_dim + column]
                z_shared[column] = projection[row, conv_dim + head * v_dim + column]
            beta = sigmoid(projection[row, conv_dim + num_v_heads * v_dim + head])
            a_logit = projection[row, conv_dim + num_v_heads * v_dim + num_v_heads + head]
            decay = float32(math.exp(ssm_a[head] * softplus(a_logit + dt_bias[head])))  # alpha = exp(g), g <= 0
            cuda.syncthreads()  # q, k, v, z staged

            partial = _ZERO
            for m in range(ROWS_PER_THREAD):
                state[m] *= decay
                partial += state[m] * k_shared[first_row + uint64(m)]
            u_partial[thread] = partial
            cuda.syncthreads()
            read = sum_in_order(u_partial, column, row_stride, groups)  # u_j = (S'ᵀk)_j, decayed state
            delta = beta * (v_shared[column] - read)

            partial = _ZERO
            for m in range(ROWS_PER_THREAD):
                state[m] += k_shared[first_row + uint64(m)] * delta
                if not prompt:
                    delta_state[base + uint64(m) * row_stride] = state[m]  # stored as soon as known: frees registers
                partial += state[m] * q_shared[first_row + uint64(m)]
            o_partial[thread] = partial
            cuda.syncthreads()
            o = sum_in_order(o_partial, column, row_stride, groups)

            # RMSNorm over the columns, which group 0 holds (its warps come first in the block, so this is the
            # order a block-wide sum of group 0's squares and everyone else's zeros would take).
            squares = warp_sum_f32(o * o)
            if group == 0 and (column & (WARP_SIZE - 1)) == 0:
                norm_partial[column // WARP_SIZE] = squares
            cuda.syncthreads()
            if group == 0:
                squares = sum_in_order(norm_partial, 0, uint64(1), uint32(v_dim // WARP_SIZE))
                inverse_rms = _ONE / float32(math.sqrt(squares / float32(v_dim) + rms_eps))
                out[row, head * v_dim + column] = o * inverse_rms * norm_weight[column] * silu(z_shared[column])

        if prompt and slot >= 0:
            for m in range(ROWS_PER_THREAD):
                delta_state[base + uint64(m) * row_stride] = state[m]

    name = "gdn_recurrent_prompt" if prompt else "gdn_recurrent_step"
    recurrent_step.__name__ = recurrent_step.__qualname__ = name
    return kernel(_RECURRENT_SIGNATURE, launch_bounds=MAX_BLOCK_THREADS, early_launch=True)(recurrent_step)


gdn_recurrent_step = _make_recurrent_step(prompt=False)
gdn_recurrent_prompt = _make_recurrent_step(prompt=True)


# -- launcher ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GatedDeltaNetShape:
    """The sizes one GDN layer's decode step needs (all from ModelConfig)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rms_eps: float

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("GDN value heads must be a multiple of key heads")
        if self.k_head_dim % WARP_SIZE or self.v_head_dim % WARP_SIZE:
            raise ValueError(
                f"GDN head sizes must be multiples of {WARP_SIZE}, got dk={self.k_head_dim} dv={self.v_head_dim}"
            )
        if max(self.k_head_dim, self.v_head_dim) > MAX_HEAD_DIM:
            raise ValueError(f"GDN head sizes above {MAX_HEAD_DIM} are not supported")
        if self.k_head_dim % ROWS_PER_THREAD:
            raise ValueError(f"GDN key head size must be a multiple of {ROWS_PER_THREAD}")
        if self.v_head_dim * (self.k_head_dim // ROWS_PER_THREAD) > MAX_BLOCK_THREADS:
            raise ValueError(
                f"GDN heads {self.k_head_dim}x{self.v_head_dim} need more than {MAX_BLOCK_THREADS} threads"
            )
        if self.conv_kernel < 2:
            raise ValueError("GDN conv kernel must be at least 2 wide")

    @classmethod
    def from_config(cls, config: ModelConfig) -> GatedDeltaNetShape:
        return cls(
            config.num_k_heads,
            config.num_v_heads,
            config.k_head_dim,
            config.v_head_dim,
            config.conv_kernel,
            config.rms_eps,
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def projection_width(self) -> int:
        """Columns of the fused input projection: qkv | z | b | a."""
        return self.conv_dim + self.num_v_heads * self.v_head_dim + 2 * self.num_v_heads

    @property
    def output_width(self) -> int:
        return self.num_v_heads * self.v_head_dim

    def delta_state_bytes(self, batch: int) -> int:
        """fp32 recurrent state one step reads (and writes again) for `batch` sequences."""
        return 4 * batch * self.num_v_heads * self.k_head_dim * self.v_head_dim


@dataclass(frozen=True, slots=True)
class GatedDeltaNetWeights:
    """One layer's small fp32 tensors, on the device (or numpy arrays under the simulator)."""

    conv_weight: Any
    """[conv_dim, K]: ssm_conv1d.weight as the reference reshapes it (tap K-1 = current token)."""
    ssm_a: Any
    """[Hv]: ssm_a, already -exp(A_log)."""
    dt_bias: Any
    """[Hv]: ssm_dt.bias."""
    norm_weight: Any
    """[dv]: ssm_norm.weight, shared by all heads."""


def decode_step(
    shape: GatedDeltaNetShape,
    weights: GatedDeltaNetWeights,
    projection: Any,
    conv_state: Any,
    delta_state: Any,
    slots: Any,
    out: Any,
    mixed: Any = None,
    *,
    tokens_per_sequence: int = 1,
) -> tuple[Launch, Launch]:
    """The two launches of one GDN layer's step for B = projection.shape[0] rows: one token of each of B
    sequences (decode), or, with `tokens_per_sequence` n, n consecutive tokens of each of B/n sequences
    (a prompt's rows, taken in order within one launch pair; the live rows of a sequence all carry its slot).

    projection [B, P] fp32 (layout in the module docstring; its qkv columns are overwritten with the mixed
    q|k|v unless `mixed` [B, conv_dim] is given), conv_state [S, K-1, conv_dim] and delta_state
    [S, Hv, dk, dv] fp32 (updated in place), slots [B] int32 (slot per row, < 0 = idle row; no slot may
    appear twice), out [B, Hv*dv] fp32. All C-contiguous.
    """
    batch, width = check_array(projection, "projection", np.float32, 2)
    if width != shape.projection_width:
        raise ValueError(f"projection must have {shape.projection_width} columns (qkv | z | b | a), got {width}")
    num_slots = check_array(conv_state, "conv_state", np.float32, 3)[0]
    check_array(conv_state, "conv_state", np.float32, 3, (num_slots, shape.conv_kernel - 1, shape.conv_dim))
    state_shape = (num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
    check_array(delta_state, "delta_state", np.float32, 4, state_shape)
    check_array(slots, "slots", np.int32, 1, (batch,))
    check_array(out, "out", np.float32, 2, (batch, shape.output_width))
    if mixed is None:
        mixed = projection
    else:
        check_array(mixed, "mixed", np.float32, 2, (batch, shape.conv_dim))
    check_array(weights.conv_weight, "weights.conv_weight", np.float32, 2, (shape.conv_dim, shape.conv_kernel))
    check_array(weights.ssm_a, "weights.ssm_a", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.dt_bias, "weights.dt_bias", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.norm_weight, "weights.norm_weight", np.float32, 1, (shape.v_head_dim,))
    if batch == 0:
        raise ValueError("a decode step needs at least one row")
    if tokens_per_sequence < 1 or batch % tokens_per_sequence:
        raise ValueError(f"{batch} rows are not whole sequences of {tokens_per_sequence} tokens")
    sequences = batch // tokens_per_sequence

    num_k_heads = np.int32(shape.num_k_heads)
    conv = Launch(
        gdn_conv_step,
        grid=(2 * shape.num_k_heads + shape.num_v_heads, sequences),
        block=(max(shape.k_head_dim, shape.v_head_dim),),
        args=(
            projection,
            weights.conv_weight,
            conv_state,
            slots,
            mixed,
            num_k_heads,
            np.int32(shape.k_head_dim),
            np.int32(shape.v_head_dim),
            np.float32(shape.k_head_dim**-0.5),  # rounded as the reference rounds it
            np.int32(tokens_per_sequence),
        ),
    )
    recurrent = Launch(
        gdn_recurrent_step if tokens_per_sequence == 1 else gdn_recurrent_prompt,
        grid=(shape.num_v_heads, sequences),
        block=(shape.v_head_dim, shape.k_head_dim // ROWS_PER_THREAD),
        args=(
            projection,
            mixed,
            weights.ssm_a,
            weights.dt_bias,
            weights.norm_weight,
            delta_state.reshape(-1),
            slots,
            out,
            num_k_heads,
            np.float32(shape.rms_eps),
            np.int32(tokens_per_sequence),
        ),
    )
    return conv, recurrent


# -- micro-benchmark (GPU only) ----------------------------------------------------------------------
