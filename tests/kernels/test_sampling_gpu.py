"""GPU token selection on a GPU (`pytest -m gpu`) at the real vocabulary (248320) and batch (16):
greedy exactly np.argmax, penalties bit for bit, the filters' kept sets, and draws that follow the
distribution `sample_token` samples (chi-square over thousands of draws of the kernels themselves)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cmpchat.cudart.profile import time_launches
from cmpchat.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    kept_threshold,
    mask_launches,
    order_keys,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.sampling import SamplingParams, apply_penalties, filtered_candidates, mask_words

pytestmark = pytest.mark.gpu

VOCAB = 248320
WIDTH = 64


class Batch:
    """Device copies of one batch's selection inputs, and the launches that select its next tokens."""

    def __init__(self, logits: np.ndarray, params: list[SamplingParams], histories=None, seeds=None) -> None:
        from numba import cuda

        batch = len(params)
        histories = histories or [[] for _ in params]
        window, count = window_from_histories(histories, WIDTH)
        self.logits = cuda.to_device(logits)
        self.params = cuda.to_device(pack_params(params, WIDTH))
        self.rng = cuda.to_device(rng_state(seeds or list(range(batch))))
        self.window, self.count = cuda.to_device(window), cuda.to_device(count)
        self.tokens = cuda.to_device(np.zeros(batch, np.int32))
        self.workspace = SamplingWorkspace.allocate(batch, logits.shape[1])
        args = (self.logits, self.params, self.rng, self.window, self.count, self.tokens, self.workspace)
        self.sampled = sampling_launches(*args)
        self.greedy = greedy_launches(self.logits, self.params, self.window, self.count, self.tokens, self.workspace)

    def select(self, greedy: bool = False) -> np.ndarray:
        for launch in self.greedy if greedy else self.sampled:
            launch.run()
        return self.tokens.copy_to_host()


def chi_square_limit(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at a one-sided normal z (4.75: p ~ 1e-6)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_greedy_is_numpy_argmax_at_full_size() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((16, VOCAB)) * 4).astype(np.float32)
    logits[0, [200_000, 1000, 123_456]] = 40.0  # ties in different chunks: lowest id
    logits[1, VOCAB - 1] = 40.0
    logits[2, :] = 0.0  # all equal: id 0
    logits[3, :] = -np.inf
    tokens = Batch(logits, [SamplingParams()] * 16).select(greedy=True)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))


def test_penalties_then_greedy_and_mixed_batches() -> None:
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, VOCAB)) * 2).astype(np.float32)
    histories = [list(np.argsort(-logits[row])[:40]) * 2 for row in range(4)]  # the likeliest tokens, twice
    params = [
        SamplingParams(repetition_penalty=1.5, penalty_window=WIDTH),
        SamplingParams(presence_penalty=2.0, frequency_penalty=0.5, penalty_window=10),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.25, penalty_window=WIDTH),
        SamplingParams(),
    ]
    batch = Batch(logits, params, histories)
    tokens = batch.select()  # the sampling pipeline: greedy rows get their argmax there too
    edited = batch.logits.copy_to_host()
    for row, (p, history) in enumerate(zip(params, histories)):
        expected = apply_penalties(logits[row], p, history)
        np.testing.assert_array_equal(edited[row], expected)
        assert tokens[row] == np.argmax(expected)


CONFIGS = [
    ("qwen thinking", 2.0, SamplingParams(temperature=0.6, top_k=20, top_p=0.95)),
    ("qwen plain", 2.0, SamplingParams(temperature=0.7, top_k=20, top_p=0.8)),
    ("nucleus, flat", 0.4, SamplingParams(temperature=1.0, top_p=0.9)),  # keeps ~10^5 tokens
    ("large top-k", 1.0, SamplingParams(temperature=1.2, top_k=5000)),
    ("min-p", 1.5, SamplingParams(temperature=1.0, min_p=0.02)),
    ("all three", 1.5, SamplingParams(temperature=0.9, top_k=300, top_p=0.7, min_p=0.01)),
    ("no filter", 1.0, SamplingParams(temperature=1.0)),
    ("top-k 1", 1.0, SamplingParams(temperature=1.0, top_k=1)),
]


def test_kept_sets_equal_sample_token_at_full_size() -> None:
    rng = np.random.default_rng(2)
    params = [p for _, _, p in CONFIGS]
    logits = np.stack([(rng.standard_normal(VOCAB) * scale).astype(np.float32) for _, scale, _ in CONFIGS])
    batch = Batch(logits, params)
    tokens = batch.select()
    state = batch.workspace.radix_state
    threshold = kept_threshold(state.copy_to_host() if hasattr(state, "copy_to_host") else state)
    keys = order_keys(logits)
    for row, (name, _, p) in enumerate(CONFIGS):
        candidates, _, keep = filtered_candidates(logits[row], p)
        z = logits[row] / np.float32(p.temperature)
        kept = (keys[row] >= threshold[row]) & ((p.min_p == 0) | (np.exp(z - z.max()) >= np.float32(p.min_p)))
        count = int(kept.sum())
        # The kept set is a prefix of the order by probability; its length is exact, except that a top-p
        # cut among ~10^5 near-equal probabilities may move by one token (fp32 exp vs float64).
        assert kept[candidates[:count]].all(), name
        slack = 1 if keep > 10_000 else 0
        assert abs(count - keep) <= slack, f"{name}: kept {count}, sample_token keeps {keep}"
        assert kept[tokens[row]], name


DRAW_ROWS, DRAW_STEPS = 16, 256  # 4096 draws per configuration
DRAW_CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=6),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.3, min_p=0.1),
]


@pytest.mark.parametrize("params", DRAW_CONFIGS, ids=["plain", "top-k", "top-p", "min-p"])
def test_draws_follow_the_distribution(params: SamplingParams) -> None:
    rows, steps = DRAW_ROWS, DRAW_STEPS
    logits = np.full(VOCAB, -30.0, np.float32)  # the rest of the vocabulary holds ~2e-8 of the mass
    hot = (np.arange(10) * 7919 + 3) % VOCAB  # spread over chunks
    logits[hot] = np.log(np.array([30, 20, 12, 9, 8, 6, 5, 4, 3, 3], np.float32))
    candidates, probs, keep = filtered_candidates(logits, params)
    expected = np.zeros(VOCAB)
    expected[candidates[:keep]] = probs[:keep] / probs[:keep].sum()

    batch = Batch(np.tile(logits, (rows, 1)), [params] * rows, seeds=list(range(100, 100 + rows)))
    drawn = np.concatenate([batch.select() for _ in range(steps)])
    counts = np.bincount(drawn, minlength=VOCAB)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    kept_hot = hot[expected[hot] > 0]
    rest = counts.sum() - counts[kept_hot].sum()  # cold tokens: ~1e-4 expected draws in all
    assert rest <= 2
    means = len(drawn) * expected[kept_hot]
    if len(kept_hot) > 1:
        chi_square = float(((counts[kept_hot] - means) ** 2 / means).sum())
        assert chi_square < chi_square_limit(len(kept_hot) - 1), (chi_square, counts[kept_hot], means)

    again = Batch(np.tile(logits, (rows, 1)), [params] * rows, seeds=list(range(100, 100 + rows)))
    np.testing.assert_array_equal(again.select(), drawn[:rows])  # the same seeds draw the same tokens


def test_selection_timing() -> None:
    """Prints µs per step for the greedy and the sampled pipelines (run with -s)."""
    rng = np.random.default_rng(4)
    for rows in (1, 16):
        logits = (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)
        batch = Batch(logits, [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)] * rows)
        greedy = time_launches(batch.greedy, repeats=50, warmup=3)
        sampled = time_launches(batch.sampled, repeats=50, warmup=3)
        print(f"B={rows}: greedy {greedy * 1e6:.1f} µs, sampled {sampled * 1e6:.1f} µs per step")
        assert greedy > 0 and sampled > 0


def test_masked_rows_choose_within_their_masks_at_full_size() -> None:
    """A grammar's mask at the real vocabulary: greedy rows pick the best allowed id, sampled rows an allowed one,
    the unmasked row of the batch its plain argmax; prints the mask launch's µs (run with -s)."""
    from numba import cuda

    rng = np.random.default_rng(5)
    rows = 4
    logits = (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)
    allowed = rng.random((rows, VOCAB)) < 0.001
    bits = np.zeros((rows, mask_words(VOCAB) * 32), np.uint8)
    bits[:, :VOCAB] = allowed
    masks = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.7),
        SamplingParams(),
    ]
    masked = [True, True, True, False]
    window, count = window_from_histories([[] for _ in params], WIDTH)
    device = {
        "logits": cuda.to_device(logits),
        "params": cuda.to_device(pack_params(params, WIDTH, masked)),
        "masks": cuda.to_device(masks),
        "rng": cuda.to_device(rng_state([1, 2, 3, 4])),
        "window": cuda.to_device(window),
        "count": cuda.to_device(count),
        "tokens": cuda.to_device(np.zeros(rows, np.int32)),
    }
    workspace = SamplingWorkspace.allocate(rows, VOCAB)
    applied = mask_launches(device["logits"], device["params"], device["masks"], workspace)
    launches = applied + sampling_launches(
        device["logits"], device["params"], device["rng"], device["window"], device["count"], device["tokens"],
        workspace,
    )  # fmt: skip
    for launch in launches:
        launch.run()
    tokens = device["tokens"].copy_to_host()
    assert tokens[0] == int(np.argmax(np.where(allowed[0], logits[0], -np.inf)))
    assert allowed[1, tokens[1]] and allowed[2, tokens[2]]
    assert tokens[3] == int(np.argmax(logits[3]))
    print(f"apply_mask at B={rows}: {time_launches(applied, repeats=50, warmup=3) * 1e6:.1f} µs")


def test_logprobs_at_full_size() -> None:
    """Log-probabilities at the real vocabulary equal numpy's log-softmax of the raw logits within 1e-4 (the
    penalised row reports its raw values); prints the report's µs per step (run with -s)."""
    from numba import cuda

    from cmpchat.kernels.sampling_logprobs import LogprobWorkspace, chosen_logprob_launches, logprob_launches
    from cmpchat.sampling import token_logprobs

    rng = np.random.default_rng(6)
    rows = 4
    logits = (rng.standard_normal((rows, VOCAB)) * 4).astype(np.float32)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(),
        SamplingParams(),
    ]
    asks = [20, 5, None, 0]
    histories = [list(np.argsort(-logits[row])[:10]) for row in range(rows)]
    window, count = window_from_histories(histories, WIDTH)
    device = {
        "logits": cuda.to_device(logits),
        "params": cuda.to_device(pack_params(params, WIDTH, None, asks)),
        "rng": cuda.to_device(rng_state([1, 2, 3, 4])),
        "window": cuda.to_device(window),
        "count": cuda.to_device(count),
        "tokens": cuda.to_device(np.zeros(rows, np.int32)),
    }
    workspace = SamplingWorkspace.allocate(rows, VOCAB)
    reports = LogprobWorkspace.allocate(rows, VOCAB, workspace.chunk)
    before = logprob_launches(device["logits"], device["params"], reports)
    launches = before + sampling_launches(
        device["logits"], device["params"], device["rng"], device["window"], device["count"], device["tokens"],
        workspace,
    ) + chosen_logprob_launches(device["params"], device["tokens"], reports)  # fmt: skip
    for launch in launches:
        launch.run()
    tokens = device["tokens"].copy_to_host()
    chosen, values, ids = (
        reports.chosen.copy_to_host(),
        reports.top_value.copy_to_host(),
        reports.top_index.copy_to_host(),
    )
    for row, top in enumerate(asks):
        if top is None:
            continue
        expected = token_logprobs(logits[row], int(tokens[row]), top)
        assert abs(chosen[row] - expected.logprob) < 1e-4
        assert ids[row, :top].tolist() == [token for token, _ in expected.top]
        np.testing.assert_allclose(values[row, :top], [value for _, value in expected.top], atol=1e-4)
    print(f"logprob_partials at B={rows}, top 20: {time_launches(before, repeats=20, warmup=2) * 1e6:.1f} µs")
