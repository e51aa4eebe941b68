"""Log-probabilities on the GPU's selection, under the CUDA simulator: the chosen token's and the top ones' equal
`cmpchat.sampling.token_logprobs` (numpy's log-softmax of the raw logits) within 1e-5, whatever the mask and
penalties then do to the logits; rows that ask for nothing are left alone."""

from __future__ import annotations

import numpy as np

from cmpchat.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    mask_launches,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.kernels.sampling_logprobs import LogprobWorkspace, chosen_logprob_launches, logprob_launches
from cmpchat.sampling import SamplingParams, mask_words, token_logprobs

VOCAB = 90
CHUNK = 32


def run(launches) -> None:
    for launch in launches:
        launch.run()


def test_logprobs_equal_numpy_for_the_rows_that_ask() -> None:
    rng = np.random.default_rng(3)
    params = [
        SamplingParams(repetition_penalty=1.8, penalty_window=8),  # greedy, penalised: reported raw
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(),  # asks for nothing
        SamplingParams(temperature=1.0),
    ]
    asks = [5, 0, None, 3]
    logits = (rng.standard_normal((4, VOCAB)) * 3).astype(np.float32)
    logits[0, [7, 50]] = logits[0].max() + 1  # a tie across chunks: the lower id ranks first
    logits[3, 60:] = logits[3].max() + 2  # the best ones all in the last (partial) chunk
    histories = [list(rng.integers(0, VOCAB, 6)) for _ in params]
    window, count = window_from_histories(histories, 8)
    masks = np.full((4, mask_words(VOCAB)), 0xFFFFFFFF, np.uint32)
    masks[1, 0] = 0  # row 1 may not choose ids 0..31
    packed = pack_params(params, 8, [False, True, False, False], asks)
    tokens = np.zeros(4, np.int32)
    workspace = SamplingWorkspace.allocate(4, VOCAB, chunk=CHUNK)
    report = LogprobWorkspace.allocate(4, VOCAB, CHUNK)
    edited = logits.copy()
    run(
        logprob_launches(edited, packed, report)
        + mask_launches(edited, packed, masks, workspace)
        + sampling_launches(edited, packed, rng_state([1, 2, 3, 4]), window, count, tokens, workspace)
        + chosen_logprob_launches(packed, tokens, report)
    )
    assert tokens[1] >= 32
    for row, top in enumerate(asks):
        if top is None:
            assert report.chosen[row] == 0 and not report.top_index[row].any()
            continue
        expected = token_logprobs(logits[row], int(tokens[row]), top)
        assert abs(report.chosen[row] - expected.logprob) < 1e-5
        assert report.top_index[row, :top].tolist() == [token for token, _ in expected.top]
        np.testing.assert_allclose(report.top_value[row, :top], [value for _, value in expected.top], atol=1e-5)
    assert report.top_index[0, :2].tolist() == [7, 50]
    assert not report.counters.any()


def test_greedy_batches_report_too_and_the_ticket_resets_between_steps() -> None:
    rng = np.random.default_rng(4)
    workspace = SamplingWorkspace.allocate(2, VOCAB, chunk=CHUNK)
    report = LogprobWorkspace.allocate(2, VOCAB, CHUNK)
    packed = pack_params([SamplingParams()] * 2, 4, None, [2, 2])
    window, count = window_from_histories([[], []], 4)
    for _ in range(2):
        logits = rng.standard_normal((2, VOCAB)).astype(np.float32)
        tokens = np.zeros(2, np.int32)
        edited = logits.copy()
        run(
            logprob_launches(edited, packed, report)
            + greedy_launches(edited, packed, window, count, tokens, workspace)
            + chosen_logprob_launches(packed, tokens, report)
        )
        for row in range(2):
            expected = token_logprobs(logits[row], int(tokens[row]), 2)
            assert abs(report.chosen[row] - expected.logprob) < 1e-5
            assert report.top_index[row, :2].tolist() == [token for token, _ in expected.top]
