"""Gated DeltaNet prefill: the T tokens of one prompt through one GDN layer, chunked (WY / UT transform) or
token by token, in fp32 on CUDA cores (docs/model.md, "Chunked form"; the algorithm and its numerical safety are
in `cmpchat.backends.reference.gated_deltanet_chunked`, its numpy reference).

Buffers are the decode step's (`gated_deltanet`): `projection [T, P]` (qkv | z | b | a per token),
`conv_state [S, K-1, conv_dim]` and `delta_state [S, Hv, dk, dv]` fp32 (slot `slot` is read and updated in
place), `out [T, Hv*dv]` = RMSNorm(o_h) * ssm_norm.weight * silu(z_h). Plus `mixed [T, conv_dim]` (the conv's
output; unlike decode it cannot overwrite the projection, as the conv of token t reads the raw inputs of
t-K+1..t, which other blocks would be overwriting) and, for the chunked path, a `ChunkWorkspace`.

Launches, chunked (`prefill_launches(..., chunked=True)`), as flash-linear-attention's chunk_gated_delta_rule:
only launch 3 is sequential over the chunks, and it does only the two products that need the running state.
1. `gdn_prefill_conv`, grid (2Hk+Hv heads, ceil(T/16)), one thread per channel, 16 tokens per block: causal
   depthwise conv (K = 4: a sliding window in registers, one load per token), SiLU, q/k L2 norm and q scaling
   as `gdn_conv_step`; outputs stay in registers until the norms are known, so each is written once (per-token
   sums of squares by 8 threads, then 1). The first tile's blocks then write the new conv state.
2. `gdn_chunk_prepare`, grid (chunks, Hv), (C/4)^2 threads (256 for C = 64), fully parallel: gates and the
   compensated cumulative log decays -> workspace.decay; K K^T and Q K^T in 4x4 register tiles over 32 key
   dims staged at a time (12 LDS.128 per 128 FMAs); A; T = (I + A)^-1 by blocked forward substitution, a 4x4
   block of T per thread in registers, C/4 steps of one barrier each (a block row of T finished and published,
   then subtracted from the later rows by all their threads at once; one thread per column solving it alone
   left 6 of 8 warps waiting at the next barrier for half the kernel); W = T diag(beta e^gamma) K ->
   workspace.w and U = T diag(beta) V -> `out`, C columns of [K | V] staged at a time (8 LDS.128 per 64 FMAs,
   stopping at T's diagonal); masked decayed Q K^T -> workspace.qk.
3. `gdn_chunk_state`, grid (Hv, dv/16) (256 blocks for 9B), max(2C, dk) = 128 threads: the state slice
   S [dk x 16] in registers (4x4 per thread) and in shared memory. Per chunk: S -> workspace.states[c];
   Delta = U - W S (4x4 tiles, dk split in two halves summed through shared memory) over U in `out`;
   S <- e^gamma_L S + K^T diag(e^(gamma_L - gamma)) Delta. W and K of the chunk are staged in one shared tile in
   turn, the next one's 16-byte loads in flight in registers while the current one is used; four barriers.
   The update S += K^T D takes four tokens a step (the tiles' rows past the chunk's length are zeros).
4. `gdn_chunk_output`, grid (dv/32, Hv, chunks), 2C threads, fully parallel: o = e^gamma Q S_c +
   (M o Q K^T) Delta in 4x4 register tiles (8 LDS.128 per 64 FMAs), over Delta in `out` (each block stages
   its Delta before writing o in its place; no other block reads it). Tiles are staged STAGE_BATCH 16-byte
   loads per thread at a time, all issued before any is stored.
5. `gdn_prefill_gated_norm`, grid (Hv, ceil(T/16)), dv threads, 16 tokens per block:
   out = RMSNorm(o) * weight * silu(z), in place.

Token by token (`chunked=False`): launches 1 and 5 with `gdn_prefill_sequential` in between: grid (Hv, dv/32),
block (32, dk/16), the state slice in registers (16 per thread) for all T tokens, q/k of 16 tokens staged
at a time, one barrier per token (u = S'^T k, S'^T q and k.q reduced together; o = S'^T q + (k.q) delta).

Numba emits no vector shared-memory access, so the register tiles use the 16-byte `load_shared_f32x4`,
`store_shared_f32x4` and `store_f32x4` of `cmpchat.cudart.intrinsics` (shared arrays declared 16-byte aligned).
Static shared memory (sm_70 allows 48 KB): prepare 36 KB, state 45 KB, output 26 KB, sequential 24.1 KB, conv and norm
16.6 KB; all for dk <= 128 (a power of two), C <= 64. ptxas for sm_70 (CUDA 12.9), registers per thread: conv 64,
prepare 128, state 255 (8 bytes spilled; none on sm_90), output 108, sequential 94, norm 60. No tensor-core
instruction (docs/hardware.md). Staging loops split indices with shifts and masks, never a division by a runtime
width (~20 instructions each: they were most of the state pass's instructions), and the chunked kernels' block-
strided loops are while loops: Numba's range() with a runtime step works out its trip count with a 64-bit
division and sign tests at every entry (prepare 4472 -> 2896 SASS instructions, output 2408 -> 1232).
"""

from __future__ import annotations

from cmpchat.kernels.gated_deltanet_chunked.common import CHUNK_SIZES, DEFAULT_CHUNK, MAX_CHUNK
from cmpchat.kernels.gated_deltanet_chunked.launch import (
    ChunkWorkspace,
    check_prefill_shape,
    num_chunks,
    prefill_launches,
)

__all__ = [
    "CHUNK_SIZES",
    "DEFAULT_CHUNK",
    "MAX_CHUNK",
    "ChunkWorkspace",
    "check_prefill_shape",
    "num_chunks",
    "prefill_launches",
]
