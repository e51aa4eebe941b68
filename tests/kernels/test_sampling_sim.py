"""GPU token selection under the CUDA simulator, against `cmpchat.sampling`.

What is exact is tested as exact: greedy argmax, the penalised logits, the kept set of the top-k / top-p /
min-p filters, and each draw (equal to a numpy emulation of the same Philox + Gumbel-max arithmetic). That
Gumbel-max over Philox uniforms samples the softmax is then a statistical test on the emulation; the GPU
tests repeat it with the kernels themselves at the real vocabulary size."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from numba import cuda, uint64
from numpy.typing import ArrayLike

from cmpchat.kernels import sampling
from cmpchat.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    order_keys,
    pack_params,
    philox_first_word,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.sampling import SamplingParams, apply_penalties, filtered_candidates

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK = np.uint64(0xFFFFFFFF)


def philox4x32(counter: Sequence[ArrayLike], key: tuple[int, int]) -> list[np.ndarray]:
    """Philox4x32-10 (Salmon et al. 2011) over uint64 arrays holding 32-bit words."""
    c = [np.asarray(word, np.uint64) for word in counter]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = np.uint64(PHILOX_M[0]) * c[0], np.uint64(PHILOX_M[1]) * c[2]
        c = [
            ((p1 >> np.uint64(32)) ^ c[1] ^ k0) & MASK,
            p1 & MASK,
            ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & MASK,
            p0 & MASK,
        ]
        k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & MASK, (k1 + np.uint64(PHILOX_W[1])) & MASK
    return c


def reference_kept(logits: np.ndarray, params: SamplingParams, history: list[int]) -> set[int]:
    """The candidates `sample_token` draws from (its own steps, stopping before the draw)."""
    logits = apply_penalties(np.asarray(logits, np.float32), params, history)
    if params.is_greedy:
        return {int(np.argmax(logits))}
    candidates, _, keep = filtered_candidates(logits, params)
    return set(candidates[:keep].tolist())


def emulated_scores(logits: np.ndarray, temperature: float, kept: np.ndarray, key: np.ndarray, draw) -> np.ndarray:
    """gumbel_draw's score per token (-inf where not kept): z + Gumbel noise from Philox(index, draw).

    `draw` may be an array of draw numbers [D, 1]: then scores are [D, V]."""
    z = logits / np.float32(temperature)
    index, draw = np.broadcast_arrays(np.arange(logits.shape[0], dtype=np.uint64), np.asarray(draw, np.uint64))
    zeros = np.zeros_like(index)
    bits = philox4x32([index, draw, zeros, zeros], (int(key[0]), int(key[1])))[0]
    uniform = ((bits >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    scores = (z - np.log(-np.log(uniform.astype(np.float64)))).astype(np.float32)
    return np.where(kept, scores, -np.inf)


def kept_mask(workspace: SamplingWorkspace, logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Tokens the kernels keep: key >= the radix threshold and exp(z - zmax) >= min_p."""
    threshold = sampling.kept_threshold(workspace.radix_state)[:, None]
    temperature = np.array([p.temperature or 1.0 for p in params], np.float32)[:, None]
    z = logits / temperature
    relative = np.exp(z - z.max(axis=1, keepdims=True))
    min_p = np.array([p.min_p for p in params], np.float32)[:, None]
    return (order_keys(logits) >= threshold) & ((min_p == 0) | (relative >= min_p))


def run(launches) -> None:
    for launch in launches:
        launch.run()


def test_philox_is_philox4x32_10() -> None:
    # Known-answer vectors of Random123 (kat_vectors, philox4x32_10).
    assert [int(w) for w in philox4x32([0, 0, 0, 0], (0, 0))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = [0xFFFFFFFF] * 4
    assert [int(w) for w in philox4x32(ones, (0xFFFFFFFF, 0xFFFFFFFF))] == [
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    ]

    @cuda.jit
    def words(out, draw, k0, k1):
        i = cuda.grid(1)
        out[i] = philox_first_word(uint64(i), uint64(draw), uint64(k0), uint64(k1))

    out = np.zeros(64, np.uint64)
    words[2, 32](out, 7, 0x12345678, 0x9ABCDEF0)
    index = np.arange(64, dtype=np.uint64)
    expected = philox4x32([index, np.full(64, 7, np.uint64), index * 0, index * 0], (0x12345678, 0x9ABCDEF0))[0]
    np.testing.assert_array_equal(out, expected)


def test_greedy_is_numpy_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 80)).astype(np.float32)
    logits[0, [5, 41, 77]] = 9.0  # ties across chunks: the lowest id wins
    logits[1, :] = -np.inf
    logits[2, 79] = 50.0
    params = [SamplingParams()] * 3
    window, count = window_from_histories([[1, 2], [], [3]], 4)
    tokens = np.zeros(3, np.int32)
    workspace = SamplingWorkspace.allocate(3, 80, chunk=32)
    run(greedy_launches(logits, pack_params(params, 4), window, count, tokens, workspace))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))
    np.testing.assert_array_equal(count, [3, 1, 2])
    assert window[0, 2] == tokens[0] and window[1, 0] == tokens[1] and window[2, 1] == tokens[2]
    assert not workspace.counters.any()


def test_penalties_match_numpy_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    vocab, width = 50, 8
    logits = (rng.standard_normal((4, vocab)) * 4).astype(np.float32)
    params = [
        SamplingParams(repetition_penalty=1.3, penalty_window=width),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.11, penalty_window=5),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, penalty_window=width),
        SamplingParams(temperature=1.0),  # no penalties: untouched
    ]
    histories = [list(rng.integers(0, 10, 13)) for _ in params]  # repeats, and longer than the ring
    window, count = window_from_histories(histories, width)
    edited = logits.copy()
    sampling.apply_penalties[4, sampling.THREADS](edited, pack_params(params, width), window, count)
    for row, (p, history) in enumerate(zip(params, histories)):
        np.testing.assert_array_equal(edited[row], apply_penalties(logits[row], p, history))
    assert (edited[:3] != logits[:3]).any(axis=1).all() and (edited[3] == logits[3]).all()


def test_filters_keep_exactly_what_sample_token_keeps_and_the_draw_is_reproducible() -> None:
    rng = np.random.default_rng(2)
    vocab = 64
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.5, top_k=30, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5, presence_penalty=0.5, penalty_window=16),
        SamplingParams(temperature=2.0),  # no filter: everything kept
        SamplingParams(),  # greedy in a sampled batch
    ]
    logits = (rng.standard_normal((len(params), vocab)) * 1.5).astype(np.float32)
    histories = [list(rng.integers(0, vocab, 6)) for _ in params]
    window, count = window_from_histories(histories, 16)
    seeds = rng_state([11, 12, 13, 14, 15, 16])
    tokens = np.zeros(len(params), np.int32)
    workspace = SamplingWorkspace.allocate(len(params), vocab, chunk=32)
    edited = logits.copy()
    run(sampling_launches(edited, pack_params(params, 16), seeds, window, count, tokens, workspace))

    kept = kept_mask(workspace, edited, params)
    for row, p in enumerate(params):
        expected = reference_kept(logits[row], p, histories[row])
        actual = {int(tokens[row])} if p.is_greedy else set(np.nonzero(kept[row])[0].tolist())
        assert actual == expected, f"row {row}: {sorted(actual)} != {sorted(expected)}"
        assert p.is_greedy or 1 < len(expected) <= vocab  # every filter has something to decide
        assert int(tokens[row]) in expected
        if not p.is_greedy:
            scores = emulated_scores(edited[row], p.temperature, kept[row], seeds[row], 0)
            assert int(tokens[row]) == int(np.argmax(scores))
    np.testing.assert_array_equal(seeds[:, 2], [1, 1, 1, 1, 1, 0])  # sampled rows advanced their draw number
    assert not workspace.counters.any() and not workspace.hist_count.any() and not workspace.hist_mass.any()


def test_gumbel_max_over_philox_samples_the_softmax() -> None:
    """The draw the kernels make (emulated exactly above), repeated: frequencies follow the probabilities."""
    logits = np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0, 0.5, 1.2], np.float32)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    draws = 20000
    key = rng_state([5])[0]
    kept = np.ones(logits.shape, bool)
    scores = emulated_scores(logits, 1.0, kept, key, np.arange(draws)[:, None])
    counts = np.bincount(np.argmax(scores, axis=1), minlength=len(logits))
    chi_square = float((((counts - draws * probs) ** 2) / (draws * probs)).sum())
    assert chi_square < 40.0  # 7 degrees of freedom: p ~ 1e-6


def test_host_helpers() -> None:
    window, count = window_from_histories([list(range(10)), [7]], 4)
    assert count.tolist() == [10, 1]
    assert sorted(window[0].tolist()) == [6, 7, 8, 9] and window[0, 9 % 4] == 9
    np.testing.assert_array_equal(rng_state([3, 3]), rng_state([3, 3]))
    assert (rng_state([3])[0, :2] != rng_state([4])[0, :2]).any()
    with pytest.raises(ValueError, match="penalty_window"):
        pack_params([SamplingParams(repetition_penalty=1.1, penalty_window=64)], 16)
    assert pack_params([SamplingParams(top_k=7)], 16)[0, sampling.P_TOP_K] == 7


def test_launchers_check_their_arguments() -> None:
    workspace = SamplingWorkspace.allocate(2, 40, chunk=16)
    logits = np.zeros((2, 40), np.float32)
    params = pack_params([SamplingParams()] * 2, 4)
    window, count = window_from_histories([[], []], 4)
    tokens = np.zeros(2, np.int32)
    assert len(sampling_launches(logits, params, rng_state([1, 2]), window, count, tokens, workspace)) == 11
    with pytest.raises(ValueError, match="workspace"):
        greedy_launches(np.zeros((2, 41), np.float32), params, window, count, tokens, workspace)
    with pytest.raises(ValueError, match="params"):
        greedy_launches(logits, params.astype(np.float32), window, count, tokens, workspace)
    with pytest.raises(ValueError, match="tokens"):
        greedy_launches(logits, params, window, count, np.zeros(3, np.int32), workspace)
    with pytest.raises(ValueError, match="rng"):
        sampling_launches(logits, params, np.zeros((2, 2), np.uint32), window, count, tokens, workspace)
