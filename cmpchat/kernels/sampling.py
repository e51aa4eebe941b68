"""Next-token selection on the GPU from fp32 logits [B, V]: only B token ids ever leave the device.

Semantics are `cmpchat.sampling.sample_token`'s: penalties over a device-resident window of
recent tokens, a grammar's allowed-token mask (`apply_mask`, only in the launch lists of steps with a
constrained row; disallowed logits to -inf, which every later step handles), then greedy argmax (temperature 0; ties to the lowest id, as np.argmax) or: z = logit / T
(fp32), keep the top-k (0 < k < V), then the smallest prefix of those by probability whose mass reaches
top_p (renormalised over the top-k, as numpy does), then those with p >= min_p * p_max, and draw one.

How (per row, in parallel over rows and over chunks of the vocabulary):
1. `apply_penalties`: one block per row edits the logits of the window's distinct tokens in place, with
   numpy's arithmetic (fp32 repetition and presence steps, the frequency step in fp64, stored as fp32).
2. `row_max`: per-chunk max/argmax; the last block of a row to finish (an atomic ticket) reduces the
   chunks: a greedy row's token is chosen here, a sampled row gets zmax = max / T.
3. `radix_pass` x 8: the top-k and top-p cuts are thresholds on an order-preserving 32-bit key of the
   logit, found exactly by MSB-first radix selection, 8 bits per pass: each pass histograms one byte of
   the keys that share the bytes chosen so far (counts for top-k; for top-p also masses exp(z - zmax) in
   fixed point, 2^-40 units in uint64, so sums are exact and order-independent: the same seed gives the
   same token), and the last block picks the byte where the running count (mass) from the top reaches k
   (top_p times the mass of the top-k set). Passes of a filter a row does not use return at once.
4. `gumbel_draw`: among kept tokens (key >= threshold, exp(z - zmax) >= min_p), argmax of z + Gumbel noise
   is an exact draw from softmax(z) restricted to them. The noise comes from Philox4x32-10 keyed by the
   sequence's seed, counter (token index, draw number): reproducible per seed, but not the same numbers as
   numpy's generator, so draws are equal in distribution, not draw for draw. The last block appends the
   token to the window and advances the draw number.
Exactness caveats: tokens with bit-identical logits exactly at a cut are all kept (numpy keeps some of
them, in an order its argpartition leaves unspecified); probabilities are fp32 exp, so a token within
~1e-7 (relative) of the top-p or min-p boundary may fall on the other side; uniforms have 23 bits.

Device-resident state the backend owns (helpers below build the host copies): params float64 [B, 10]
(`pack_params`), rng uint32 [B, 4] (seed, seed, draw number, unused; `rng_state`), window int32 [B, W] a
ring of the last tokens with window_count int32 [B] tokens ever appended (`window_from_histories`), the
output tokens int32 [B], and a `SamplingWorkspace` (scratch, allocated once per batch size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import SIMULATOR, WARP_SIZE, shfl_xor_f32, shfl_xor_i32
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.sampling import SamplingParams

THREADS = 32 if SIMULATOR else 256  # the simulator runs a Python thread per CUDA thread
DEFAULT_CHUNK = 4096  # vocabulary entries per block: V = 248320 gives 61 blocks per row
RADIX_BITS = 8
BINS = 1 << RADIX_BITS
PASSES_PER_CUT = 32 // RADIX_BITS
RADIX_PASSES = 2 * PASSES_PER_CUT  # top-k cut, then top-p cut
TICKETS = 2 + RADIX_PASSES  # last-block tickets per row: row_max, each radix pass, gumbel_draw
TICKET_ROW_MAX, TICKET_DRAW = 0, 1 + RADIX_PASSES
MASS_SCALE = 2.0**40  # fixed-point unit of exp(z - zmax) <= 1; V * 2^40 < 2^58 fits uint64

P_TEMPERATURE, P_TOP_K, P_TOP_P, P_MIN_P, P_REPETITION, P_PRESENCE, P_FREQUENCY, P_WINDOW, P_MASKED, P_LOGPROBS = range(
    10
)
PARAM_COUNT = 10
# radix_state columns: per cut (0 top-k, 1 top-p) at 4 * cut: key prefix, count above, mass above, target.
STATE_COLUMNS = 8
NO_INDEX = 0x7FFFFFFF

_U8, _U32, _MASK32 = np.uint64(RADIX_BITS), np.uint64(32), np.uint64(0xFFFFFFFF)
_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)


@cuda.jit(device=True, inline=True)
def order_key(value):
    """uint32 bits (as uint64) that order like the float32 `value`: larger key = larger value."""
    scratch = cuda.local.array(1, float32)  # a bit cast: LLVM turns the round trip into a register move
    scratch[0] = value
    bits = uint64(scratch.view(np.uint32)[0])
    if bits >= uint64(0x80000000):
        return _MASK32 - bits  # negative: flip all bits
    return bits + uint64(0x80000000)


@cuda.jit(device=True, inline=True)
def philox_first_word(c0, c1, k0, k1):
    """Output word 0 of Philox4x32-10 for counter (c0, c1, 0, 0) and key (k0, k1); uint32 values as uint64."""
    c2 = c3 = uint64(0)
    for _ in range(10):
        product0 = _PHILOX_M0 * c0
        product1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = (
            ((product1 >> _U32) ^ c1 ^ k0) & _MASK32,
            product1 & _MASK32,
            ((product0 >> _U32) ^ c3 ^ k1) & _MASK32,
            product0 & _MASK32,
        )
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0


@cuda.jit(device=True, inline=True)
def better(value, index, other_value, other_index):
    return other_value > value or (other_value == value and other_index < index)


@cuda.jit(device=True)
def block_argmax(value, index):
    """(max value, lowest index holding it) over the block; every thread gets it (all threads must call)."""
    for offset in (16, 8, 4, 2, 1):
        other_value = shfl_xor_f32(value, offset)
        other_index = shfl_xor_i32(index, offset)
        if better(value, index, other_value, other_index):
            value, index = other_value, other_index
    values = cuda.shared.array(32, float32)
    indices = cuda.shared.array(32, int32)
    if cuda.threadIdx.x % WARP_SIZE == 0:
        values[cuda.threadIdx.x // WARP_SIZE] = value
        indices[cuda.threadIdx.x // WARP_SIZE] = index
    cuda.syncthreads()
    value, index = values[0], indices[0]
    for w in range(1, cuda.blockDim.x // WARP_SIZE):
        if better(value, index, values[w], indices[w]):
            value, index = values[w], indices[w]
    cuda.syncthreads()  # the shared slots may be reused by the next call
    return value, index


@cuda.jit(device=True)
def last_block(counters, row, ticket):
    """True in every thread of the row's last block to get here (after all its global writes)."""
    flag = cuda.shared.array(1, int32)
    cuda.threadfence()  # this block's atomics and stores are visible before its ticket
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        flag[0] = 1 if cuda.atomic.add(counters, (row, ticket), uint32(1)) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    is_last = flag[0] == 1
    if is_last and cuda.threadIdx.x == 0:
        counters[row, ticket] = uint32(0)  # ready for the next step (and the next graph replay)
    return is_last


@cuda.jit(device=True)
def row_winner(value, index, partial_value, partial_index, counters, row, ticket):
    """Each block's (value, index) winner goes to the partials; the row's last block to finish reduces them.
    Returns (is last block, row winner) in every thread; the winner is only meaningful in the last block."""
    value, index = block_argmax(value, index)
    if cuda.threadIdx.x == 0:
        partial_value[row, cuda.blockIdx.x] = value
        partial_index[row, cuda.blockIdx.x] = index
    if not last_block(counters, row, ticket):
        return False, value, index
    value, index = float32(-math.inf), int32(NO_INDEX)
    for c in range(cuda.threadIdx.x, cuda.gridDim.x, cuda.blockDim.x):
        if better(value, index, partial_value[row, c], partial_index[row, c]):
            value, index = partial_value[row, c], partial_index[row, c]
    value, index = block_argmax(value, index)
    return True, value, index


@cuda.jit(device=True)
def append_token(token, row, tokens, window, window_count):
    tokens[row] = token
    count = window_count[row]
    window[row, count % window.shape[1]] = token
    window_count[row] = count + 1


@kernel("void(float32[:, ::1], float64[:, ::1], int32[:, ::1], int32[::1])")
def apply_penalties(logits, params, window, window_count):
    row = cuda.blockIdx.x
    repetition, presence, frequency = params[row, P_REPETITION], params[row, P_PRESENCE], params[row, P_FREQUENCY]
    if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
        return
    width, count = window.shape[1], window_count[row]
    recent = min(int32(params[row, P_WINDOW]), count, width)
    for i in range(cuda.threadIdx.x, recent, cuda.blockDim.x):
        token = window[row, (count - 1 - i) % width]
        seen, first = 0, True  # only the first occurrence edits the logit: no two threads write one token
        for j in range(recent):
            if window[row, (count - 1 - j) % width] == token:
                seen += 1
                first = first and j >= i
        if first and 0 <= token < logits.shape[1]:
            value = logits[row, token]
            if repetition != 1.0:
                value = value / float32(repetition) if value > 0 else value * float32(repetition)
            value = value - float32(presence)
            logits[row, token] = float32(float64(value) - frequency * float64(seen))


@kernel("void(float32[:, ::1], float64[:, ::1], uint32[:, ::1], int32)")
def apply_mask(logits, params, mask, chunk):
    """Disallowed ids of a masked row to -inf (bit i % 32 of mask word i // 32 clear); other rows return."""
    row, start = cuda.blockIdx.y, cuda.blockIdx.x * chunk
    if params[row, P_MASKED] == 0.0:
        return
    for i in range(start + cuda.threadIdx.x, min(start + chunk, logits.shape[1]), cuda.blockDim.x):
        if (mask[row, i >> 5] >> uint32(i & 31)) & uint32(1) == uint32(0):
            logits[row, i] = float32(-math.inf)


@kernel(
    "void(float32[:, ::1], float64[:, ::1], float32[:, ::1], int32[:, ::1], float32[:, ::1], uint64[:, ::1], "
    "uint32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32)"
)
def row_max(logits, params, partial_value, partial_index, row_stats, radix_state, counters, tokens, window,
            window_count, chunk):  # fmt: skip
    row, start = cuda.blockIdx.y, cuda.blockIdx.x * chunk
    stop = min(start + chunk, logits.shape[1])
    value, index = float32(-math.inf), int32(NO_INDEX)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        if better(value, index, logits[row, i], i):  # ties (also all -inf) to the lowest index
            value, index = logits[row, i], int32(i)
    is_last, value, index = row_winner(value, index, partial_value, partial_index, counters, row, TICKET_ROW_MAX)
    if not is_last:
        return
    if cuda.threadIdx.x == 0:
        temperature = params[row, P_TEMPERATURE]
        if temperature == 0.0:
            append_token(index, row, tokens, window, window_count)
        else:
            row_stats[row, 0] = value / float32(temperature)  # zmax: division is monotone, so max(z) = max/T
            row_stats[row, 1] = value
            for column in range(STATE_COLUMNS):
                radix_state[row, column] = uint64(0)


@kernel(
    "void(float32[:, ::1], float64[:, ::1], float32[:, ::1], uint64[:, ::1], uint32[:, :, ::1], "
    "uint64[:, :, ::1], uint32[:, ::1], int32, int32)"
)
def radix_pass(logits, params, row_stats, radix_state, hist_count, hist_mass, counters, chunk, pass_index):
    row, start = cuda.blockIdx.y, cuda.blockIdx.x * chunk
    vocab = logits.shape[1]
    temperature, top_k, top_p = params[row, P_TEMPERATURE], params[row, P_TOP_K], params[row, P_TOP_P]
    cut = pass_index // PASSES_PER_CUT  # 0: top-k by count, 1: top-p by mass within the top-k
    if temperature == 0.0 or (cut == 0 and not 0.0 < top_k < vocab) or (cut == 1 and not top_p < 1.0):
        return  # the whole grid row returns alike, so no ticket is taken
    shift = uint64(32 - RADIX_BITS * (pass_index % PASSES_PER_CUT + 1))
    column = 4 * cut
    prefix = radix_state[row, column]
    floor_key = radix_state[row, 0] if cut == 1 else uint64(0)  # the top-k threshold (0 when unused)
    first_pass = pass_index % PASSES_PER_CUT == 0
    zmax, temperature32 = row_stats[row, 0], float32(temperature)

    count = cuda.shared.array(BINS, uint32)
    mass = cuda.shared.array(BINS, uint64)
    for b in range(cuda.threadIdx.x, BINS, cuda.blockDim.x):
        count[b] = uint32(0)
        mass[b] = uint64(0)
    cuda.syncthreads()
    for i in range(start + cuda.threadIdx.x, min(start + chunk, vocab), cuda.blockDim.x):
        logit = logits[row, i]
        key = order_key(logit)
        if key >= floor_key and (first_pass or (key >> (shift + _U8)) == (prefix >> (shift + _U8))):
            b = (key >> shift) & uint64(BINS - 1)
            cuda.atomic.add(count, b, uint32(1))
            if cut == 1:
                e = math.exp(logit / temperature32 - zmax)
                cuda.atomic.add(mass, b, uint64(e * float32(MASS_SCALE)))
    cuda.syncthreads()
    for b in range(cuda.threadIdx.x, BINS, cuda.blockDim.x):
        if count[b] != 0:
            cuda.atomic.add(hist_count, (pass_index, row, b), count[b])
            if cut == 1:
                cuda.atomic.add(hist_mass, (pass_index, row, b), mass[b])
    if not last_block(counters, row, 1 + pass_index):
        return
    if cuda.threadIdx.x == 0:
        target = radix_state[row, column + 3]
        if cut == 0 and first_pass:
            target = uint64(top_k)
        elif cut == 1 and first_pass:  # top_p of the mass of the top-k set (all of it: the first pass)
            total = uint64(0)
            for b in range(BINS):
                total += hist_mass[pass_index, row, b]
            target = max(uint64(top_p * float64(total)), uint64(1))
        radix_state[row, column + 3] = target
        above = radix_state[row, column + 1 + cut]
        chosen = BINS - 1
        while chosen > 0:  # from the top bin down: where the running count (mass) reaches the target
            weight = uint64(hist_count[pass_index, row, chosen]) if cut == 0 else hist_mass[pass_index, row, chosen]
            if above + weight >= target:
                break
            above += weight
            chosen -= 1
        radix_state[row, column] = prefix | (uint64(chosen) << shift)
        radix_state[row, column + 1 + cut] = above
    cuda.syncthreads()  # thread 0 has read the histogram
    for b in range(cuda.threadIdx.x, BINS, cuda.blockDim.x):  # leave the histogram zeroed for the next step
        hist_count[pass_index, row, b] = uint32(0)
        hist_mass[pass_index, row, b] = uint64(0)


@kernel(
    "void(float32[:, ::1], float64[:, ::1], float32[:, ::1], uint64[:, ::1], uint32[:, ::1], float32[:, ::1], "
    "int32[:, ::1], uint32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32)"
)
def gumbel_draw(logits, params, row_stats, radix_state, rng, partial_value, partial_index, counters, tokens,
                window, window_count, chunk):  # fmt: skip
    row, start = cuda.blockIdx.y, cuda.blockIdx.x * chunk
    temperature, min_p = params[row, P_TEMPERATURE], float32(params[row, P_MIN_P])
    if temperature == 0.0:
        return
    threshold = max(radix_state[row, 0], radix_state[row, 4])
    zmax, temperature32 = row_stats[row, 0], float32(temperature)
    key0, key1, draw = uint64(rng[row, 0]), uint64(rng[row, 1]), uint64(rng[row, 2])
    value, index = float32(-math.inf), int32(NO_INDEX)
    for i in range(start + cuda.threadIdx.x, min(start + chunk, logits.shape[1]), cuda.blockDim.x):
        logit = logits[row, i]
        z = logit / temperature32
        if order_key(logit) >= threshold and (min_p == float32(0.0) or math.exp(z - zmax) >= min_p):
            bits = philox_first_word(uint64(i), draw, key0, key1)
            uniform = (float32(bits >> uint64(9)) + float32(0.5)) * float32(2.0**-23)  # in (0, 1), exact
            score = z - math.log(-math.log(uniform))
            if better(value, index, score, i):
                value, index = score, int32(i)
    is_last, value, index = row_winner(value, index, partial_value, partial_index, counters, row, TICKET_DRAW)
    if not is_last:
        return
    if cuda.threadIdx.x == 0:
        append_token(index, row, tokens, window, window_count)
        rng[row, 2] = uint32(draw + uint64(1))


# ---------------------------------------------------------------------------------------------- host side


@dataclass
class SamplingWorkspace:
    """Scratch for one batch size and vocabulary (device arrays, or numpy under the simulator).

    The tickets and histograms must start at zero (as allocated); the kernels leave them zeroed.
    """

    batch: int
    vocab: int
    chunk: int
    partial_value: Any  # float32 [B, chunks]: per-chunk maxima, then per-chunk draws
    partial_index: Any  # int32 [B, chunks]
    row_stats: Any  # float32 [B, 2]: zmax = max(logit) / T, max(logit)
    radix_state: Any  # uint64 [B, 8]: see STATE_COLUMNS
    hist_count: Any  # uint32 [RADIX_PASSES, B, BINS]
    hist_mass: Any  # uint64 [RADIX_PASSES, B, BINS]
    counters: Any  # uint32 [B, TICKETS]

    @property
    def chunks(self) -> int:
        return (self.vocab + self.chunk - 1) // self.chunk

    @classmethod
    def allocate(cls, batch: int, vocab: int, *, chunk: int = DEFAULT_CHUNK) -> SamplingWorkspace:
        if batch < 1 or vocab < 1 or chunk < 1:
            raise ValueError(f"need batch, vocab and chunk >= 1, got {batch}, {vocab}, {chunk}")
        chunks = (vocab + chunk - 1) // chunk
        host = {
            "partial_value": np.zeros((batch, chunks), np.float32),
            "partial_index": np.zeros((batch, chunks), np.int32),
            "row_stats": np.zeros((batch, 2), np.float32),
            "radix_state": np.zeros((batch, STATE_COLUMNS), np.uint64),
            "hist_count": np.zeros((RADIX_PASSES, batch, BINS), np.uint32),
            "hist_mass": np.zeros((RADIX_PASSES, batch, BINS), np.uint64),
            "counters": np.zeros((batch, TICKETS), np.uint32),
        }
        arrays = host if SIMULATOR else {name: cuda.to_device(value) for name, value in host.items()}
        return cls(batch, vocab, chunk, **arrays)


def pack_params(
    params: Sequence[SamplingParams],
    window_width: int,
    masked: Sequence[bool] | None = None,
    logprobs: Sequence[int | None] | None = None,
) -> np.ndarray:
    """float64 [B, PARAM_COUNT] device copy of each sequence's sampling parameters (the column order of P_*);
    `masked` says which rows `apply_mask` constrains (none by default), `logprobs` how many most likely tokens
    each row reports (None: no report; -1 in the column)."""
    flags = masked if masked is not None else [False] * len(params)
    reports = logprobs if logprobs is not None else [None] * len(params)
    rows = []
    for p, flag, report in zip(params, flags, reports, strict=True):
        if p.has_penalties and p.penalty_window > window_width:
            raise ValueError(f"penalty_window {p.penalty_window} exceeds the device window of {window_width} tokens")
        rows.append(
            (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
             p.frequency_penalty, p.penalty_window, float(flag), -1.0 if report is None else float(report))
        )  # fmt: skip
    return np.array(rows, dtype=np.float64).reshape(len(rows), PARAM_COUNT)


def rng_state(seeds: Sequence[int | None]) -> np.ndarray:
    """uint32 [B, 4]: a Philox key from each seed (fresh entropy for None) and draw number 0."""
    state = np.zeros((len(seeds), 4), np.uint32)
    for row, seed in enumerate(seeds):
        key = np.random.SeedSequence(seed).generate_state(2, np.uint32)
        state[row, :2] = key
    return state


def window_from_histories(histories: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(window int32 [B, width], window_count int32 [B]): each history's last `width` tokens as a ring."""
    if width < 1:
        raise ValueError(f"the window needs at least one slot, got {width}")
    window = np.zeros((len(histories), width), np.int32)
    count = np.zeros(len(histories), np.int32)
    for row, history in enumerate(histories):
        recent = list(history[-width:])  # not list(history): a history holds the whole context
        start = len(history) - len(recent)
        for i, token in enumerate(recent):
            window[row, (start + i) % width] = token
        count[row] = len(history)
    return window, count


def _check_rows(
    logits: Any, params: Any, window: Any, window_count: Any, tokens: Any, workspace: SamplingWorkspace
) -> int:
    batch, vocab = check_array(logits, "logits", np.float32, 2)
    if (batch, vocab) != (workspace.batch, workspace.vocab):
        raise ValueError(f"logits {(batch, vocab)} do not match the workspace {(workspace.batch, workspace.vocab)}")
    check_array(params, "params", np.float64, 2, (batch, PARAM_COUNT))
    _, width = check_array(window, "window", np.int32, 2)
    if width < 1 or window.shape[0] != batch:
        raise ValueError(f"window must be int32 [{batch}, W >= 1], got {tuple(window.shape)}")
    check_array(window_count, "window_count", np.int32, 1, (batch,))
    check_array(tokens, "tokens", np.int32, 1, (batch,))
    return batch


def greedy_launches(logits: Any, params: Any, window: Any, window_count: Any, tokens: Any,
                    workspace: SamplingWorkspace) -> list[Launch]:  # fmt: skip
    """Penalties then argmax, for a batch whose rows all have temperature 0 (2 launches).

    Writes tokens int32 [B] and appends each to its window; logits are edited in place by the penalties.
    """
    batch = _check_rows(logits, params, window, window_count, tokens, workspace)
    ws = workspace
    return [
        Launch(apply_penalties, batch, THREADS, (logits, params, window, window_count)),
        Launch(row_max, (ws.chunks, batch), THREADS,
               (logits, params, ws.partial_value, ws.partial_index, ws.row_stats, ws.radix_state, ws.counters,
                tokens, window, window_count, np.int32(ws.chunk))),
    ]  # fmt: skip


def sampling_launches(logits: Any, params: Any, rng: Any, window: Any, window_count: Any, tokens: Any,
                      workspace: SamplingWorkspace) -> list[Launch]:  # fmt: skip
    """The whole selection for any mix of greedy and sampled rows (11 launches; unused filters return
    at once). rng uint32 [B, 4] from `rng_state`; other arguments as `greedy_launches`."""
    batch = _check_rows(logits, params, window, window_count, tokens, workspace)
    check_array(rng, "rng", np.uint32, 2, (batch, 4))
    ws = workspace
    launches = greedy_launches(logits, params, window, window_count, tokens, workspace)
    for pass_index in range(RADIX_PASSES):
        launches.append(
            Launch(radix_pass, (ws.chunks, batch), THREADS,
                   (logits, params, ws.row_stats, ws.radix_state, ws.hist_count, ws.hist_mass, ws.counters,
                    np.int32(ws.chunk), np.int32(pass_index)))
        )  # fmt: skip
    launches.append(
        Launch(gumbel_draw, (ws.chunks, batch), THREADS,
               (logits, params, ws.row_stats, ws.radix_state, rng, ws.partial_value, ws.partial_index,
                ws.counters, tokens, window, window_count, np.int32(ws.chunk)))
    )  # fmt: skip
    return launches


def mask_launches(logits: Any, params: Any, mask: Any, workspace: SamplingWorkspace) -> list[Launch]:
    """The allowed-token masks of the rows flagged P_MASKED applied to their logits in place (1 launch, before
    `greedy_launches` or `sampling_launches`: it commutes with the penalties, which keep -inf at -inf).
    mask uint32 [B, ceil(V / 32)], llguidance's bit layout."""
    batch, vocab = check_array(logits, "logits", np.float32, 2)
    if (batch, vocab) != (workspace.batch, workspace.vocab):
        raise ValueError(f"logits {(batch, vocab)} do not match the workspace {(workspace.batch, workspace.vocab)}")
    check_array(params, "params", np.float64, 2, (batch, PARAM_COUNT))
    check_array(mask, "mask", np.uint32, 2, (batch, (vocab + 31) // 32))
    ws = workspace
    return [Launch(apply_mask, (ws.chunks, batch), THREADS, (logits, params, mask, np.int32(ws.chunk)))]


def kept_threshold(workspace_state: np.ndarray) -> np.ndarray:
    """The key threshold per row after the radix passes (host copy of radix_state): for tests and tools."""
    return np.maximum(workspace_state[:, 0], workspace_state[:, 4])


def order_keys(logits: np.ndarray) -> np.ndarray:
    """The kernels' order-preserving keys of fp32 logits, on the host (uint64)."""
    bits = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return np.where(bits >= 0x80000000, np.uint64(0xFFFFFFFF) - bits, bits + np.uint64(0x80000000))
