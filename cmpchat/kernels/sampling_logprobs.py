"""Log-probabilities of the raw logits on the GPU, for the rows that ask (`P_LOGPROBS` >= 0 in the selection's
params): the chosen token's log-softmax and the `top` most likely tokens', as `cmpchat.sampling.token_logprobs`.

Launched around a selection (`cmpchat.kernels.sampling`): `logprob_partials` first, before the mask and the
penalties edit the logits, then the selection, then `chosen_logprob` once the token is chosen.
1. `logprob_partials` (grid: chunks x rows): each block copies its chunk of the raw logits aside (the chosen
   token's raw logit is read after the selection), and writes its chunk's max m, sum of exp(logit - m), and its
   chunk's `top` best (logit, id) pairs, found by `top` block-wide argmax rounds each taking the best pair ranked
   below the last one (larger logit first, then lower id, as numpy's stable sort of -logits). The row's last block
   (an atomic ticket) merges them: log-sum-exp = M + log(sum of s_c exp(m_c - M)), and the row's top pairs by the
   same rounds over the chunks' candidates, written as log-probabilities.
2. `chosen_logprob` (one block): raw logit of each row's chosen token minus its log-sum-exp.
Values are fp32 (sums of at most `chunk` terms per thread, then per block), within ~1e-6 of numpy's fp64 at
Qwen's 248k ids; a row that asks for nothing returns at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import SIMULATOR, WARP_SIZE, shfl_xor_f32
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.sampling import NO_INDEX, P_LOGPROBS, PARAM_COUNT, THREADS, better, block_argmax, last_block

MAX_TOP = 20
"""The most `top_logprobs` a row may ask for (OpenAI's limit)."""


@cuda.jit(device=True, inline=True)
def ranked_below(value, index, last_value, last_index):
    """Whether (value, index) comes after (last_value, last_index) in the order larger value, then lower index."""
    return value < last_value or (value == last_value and index > last_index)


@cuda.jit(device=True)
def block_sum(value):
    """The sum of `value` over the block; every thread gets it (all threads must call)."""
    for offset in (16, 8, 4, 2, 1):
        value += shfl_xor_f32(value, offset)
    sums = cuda.shared.array(32, float32)
    if cuda.threadIdx.x % WARP_SIZE == 0:
        sums[cuda.threadIdx.x // WARP_SIZE] = value
    cuda.syncthreads()
    total = float32(0.0)
    for w in range(cuda.blockDim.x // WARP_SIZE):
        total += sums[w]
    cuda.syncthreads()  # the shared slots may be reused by the next call
    return total


@kernel(
    "void(float32[:, ::1], float64[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], "
    "int32[:, :, ::1], uint32[:, ::1], float32[::1], float32[:, ::1], int32[:, ::1], int32)"
)
def logprob_partials(logits, params, raw, chunk_stats, chunk_top_value, chunk_top_index, counters, lse, top_value,
                     top_index, chunk):  # fmt: skip
    row, block = cuda.blockIdx.y, cuda.blockIdx.x
    top = int32(params[row, P_LOGPROBS])
    if top < 0:
        return
    start = block * chunk
    stop = min(start + chunk, logits.shape[1])
    peak = float32(-math.inf)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        value = logits[row, i]
        raw[row, i] = value
        peak = max(peak, value)
    peak, _ = block_argmax(peak, int32(0))
    total = float32(0.0)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        total += math.exp(logits[row, i] - peak)
    total = block_sum(total)
    last_value, last_index = float32(math.inf), int32(-1)
    for k in range(top):
        value, index = float32(-math.inf), int32(NO_INDEX)
        for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
            candidate = logits[row, i]
            if ranked_below(candidate, i, last_value, last_index) and better(value, index, candidate, i):
                value, index = candidate, int32(i)
        value, index = block_argmax(value, index)
        if cuda.threadIdx.x == 0:
            chunk_top_value[row, block, k] = value
            chunk_top_index[row, block, k] = index
        last_value, last_index = value, index
    if cuda.threadIdx.x == 0:
        chunk_stats[row, block, 0] = peak
        chunk_stats[row, block, 1] = total
    if not last_block(counters, row, 0):
        return
    chunks = cuda.gridDim.x
    peak = float32(-math.inf)
    for c in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
        peak = max(peak, chunk_stats[row, c, 0])
    peak, _ = block_argmax(peak, int32(0))
    total = float32(0.0)
    for c in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
        total += chunk_stats[row, c, 1] * math.exp(chunk_stats[row, c, 0] - peak)
    log_total = peak + math.log(block_sum(total))
    last_value, last_index = float32(math.inf), int32(-1)
    for k in range(top):
        value, index = float32(-math.inf), int32(NO_INDEX)
        for j in range(cuda.threadIdx.x, chunks * top, cuda.blockDim.x):
            c, slot = j // top, j % top
            candidate, candidate_index = chunk_top_value[row, c, slot], chunk_top_index[row, c, slot]
            if ranked_below(candidate, candidate_index, last_value, last_index) and better(
                value, index, candidate, candidate_index
            ):
                value, index = candidate, candidate_index
        value, index = block_argmax(value, index)
        if cuda.threadIdx.x == 0:
            top_value[row, k] = value - log_total
            top_index[row, k] = index
        last_value, last_index = value, index
    if cuda.threadIdx.x == 0:
        lse[row] = log_total


@kernel("void(float32[:, ::1], float64[:, ::1], int32[::1], float32[::1], float32[::1])")
def chosen_logprob(raw, params, tokens, lse, chosen):
    for row in range(cuda.threadIdx.x, tokens.shape[0], cuda.blockDim.x):
        if params[row, P_LOGPROBS] >= 0.0:
            chosen[row] = raw[row, tokens[row]] - lse[row]


@dataclass
class LogprobWorkspace:
    """Scratch and results of the log-probability kernels for one batch size and vocabulary (device arrays, or
    numpy under the simulator). The ticket counters must start at zero (as allocated); the kernels leave them so.
    Results: `chosen` float32 [B], `top_value` float32 [B, MAX_TOP], `top_index` int32 [B, MAX_TOP] (each row's
    first `top` entries)."""

    batch: int
    vocab: int
    chunk: int
    raw: Any  # float32 [B, V]: the logits before the mask and the penalties
    chunk_stats: Any  # float32 [B, chunks, 2]: max, sum of exp(logit - max)
    chunk_top_value: Any  # float32 [B, chunks, MAX_TOP]
    chunk_top_index: Any  # int32 [B, chunks, MAX_TOP]
    counters: Any  # uint32 [B, 1]
    lse: Any  # float32 [B]: log-sum-exp of the raw logits
    chosen: Any
    top_value: Any
    top_index: Any

    @property
    def chunks(self) -> int:
        return (self.vocab + self.chunk - 1) // self.chunk

    @classmethod
    def allocate(cls, batch: int, vocab: int, chunk: int) -> LogprobWorkspace:
        chunks = (vocab + chunk - 1) // chunk
        host = {
            "raw": np.zeros((batch, vocab), np.float32),
            "chunk_stats": np.zeros((batch, chunks, 2), np.float32),
            "chunk_top_value": np.zeros((batch, chunks, MAX_TOP), np.float32),
            "chunk_top_index": np.zeros((batch, chunks, MAX_TOP), np.int32),
            "counters": np.zeros((batch, 1), np.uint32),
            "lse": np.zeros(batch, np.float32),
            "chosen": np.zeros(batch, np.float32),
            "top_value": np.zeros((batch, MAX_TOP), np.float32),
            "top_index": np.zeros((batch, MAX_TOP), np.int32),
        }
        arrays = host if SIMULATOR else {name: cuda.to_device(value) for name, value in host.items()}
        return cls(batch, vocab, chunk, **arrays)


def logprob_launches(logits: Any, params: Any, workspace: LogprobWorkspace) -> list[Launch]:
    """The launch before a selection (1): raw copies, log-sum-exp and top ids of the rows that ask. `params` is
    the selection's packed params (`sampling.pack_params` with `logprobs`; at most MAX_TOP a row)."""
    batch, vocab = check_array(logits, "logits", np.float32, 2)
    if (batch, vocab) != (workspace.batch, workspace.vocab):
        raise ValueError(f"logits {(batch, vocab)} do not match the workspace {(workspace.batch, workspace.vocab)}")
    check_array(params, "params", np.float64, 2, (batch, PARAM_COUNT))
    ws = workspace
    args = (logits, params, ws.raw, ws.chunk_stats, ws.chunk_top_value, ws.chunk_top_index, ws.counters, ws.lse,
            ws.top_value, ws.top_index, np.int32(ws.chunk))  # fmt: skip
    return [Launch(logprob_partials, (ws.chunks, batch), THREADS, args)]


def chosen_logprob_launches(params: Any, tokens: Any, workspace: LogprobWorkspace) -> list[Launch]:
    """The launch after a selection (1): the chosen tokens' log-probabilities into `workspace.chosen`."""
    check_array(tokens, "tokens", np.int32, 1, (workspace.batch,))
    ws = workspace
    return [Launch(chosen_logprob, 1, THREADS, (ws.raw, params, tokens, ws.lse, ws.chosen))]
