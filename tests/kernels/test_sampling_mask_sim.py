"""The allowed-token mask on the GPU's selection, under the CUDA simulator, against `cmpchat.sampling`: masked
rows choose among their allowed ids exactly as `sample_token` does, unmasked rows of the same batch are untouched."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    mask_launches,
    order_keys,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.sampling import SamplingParams, allowed_ids, apply_mask, apply_penalties, filtered_candidates, mask_words

VOCAB = 70  # three mask words, the last one partly past the vocabulary


def packed(allowed: np.ndarray) -> np.ndarray:
    """The packed uint32 mask of a bool [V] array (llguidance's layout)."""
    bits = np.zeros(mask_words(allowed.shape[0]) * 32, np.uint8)
    bits[: allowed.shape[0]] = allowed
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def run(launches) -> None:
    for launch in launches:
        launch.run()


def test_packing_round_trips() -> None:
    allowed = np.random.default_rng(0).random(VOCAB) < 0.3
    np.testing.assert_array_equal(allowed_ids(packed(allowed), VOCAB), allowed)


def test_masked_greedy_rows_pick_the_best_allowed_id_and_others_are_untouched() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, VOCAB)).astype(np.float32)
    allowed = rng.random((3, VOCAB)) < 0.2
    allowed[0, 69] = True  # the last id, in the partial word
    logits[0, 69] = 9.0
    masks = np.stack([packed(row) for row in allowed])
    masked = [True, True, False]
    params = pack_params([SamplingParams()] * 3, 4, masked)
    window, count = window_from_histories([[], [], []], 4)
    tokens = np.zeros(3, np.int32)
    workspace = SamplingWorkspace.allocate(3, VOCAB, chunk=32)
    edited = logits.copy()
    run(
        mask_launches(edited, params, masks, workspace)
        + greedy_launches(edited, params, window, count, tokens, workspace)
    )
    assert tokens[0] == 69
    assert tokens[1] == int(np.argmax(np.where(allowed[1], logits[1], -np.inf)))
    assert tokens[2] == int(np.argmax(logits[2]))  # not masked: its (all-zero) mask row is not read
    np.testing.assert_array_equal(edited[2], logits[2])
    assert np.all(np.isneginf(edited[1][~allowed[1]])) and np.all(edited[1][allowed[1]] == logits[1][allowed[1]])


def test_masked_sampled_rows_keep_what_sample_token_keeps() -> None:
    rng = np.random.default_rng(2)
    params = [
        SamplingParams(temperature=1.0, top_k=40),  # more than the allowed ids: -inf ones fill the top-k
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, penalty_window=8),
        SamplingParams(temperature=1.0),
    ]
    logits = (rng.standard_normal((len(params), VOCAB)) * 2).astype(np.float32)
    allowed = rng.random((len(params), VOCAB)) < 0.25
    histories = [list(rng.integers(0, VOCAB, 5)) for _ in params]
    window, count = window_from_histories(histories, 8)
    masks = np.stack([packed(row) for row in allowed])
    packed_params = pack_params(params, 8, [True] * len(params))
    tokens = np.zeros(len(params), np.int32)
    workspace = SamplingWorkspace.allocate(len(params), VOCAB, chunk=32)
    edited = logits.copy()
    launches = mask_launches(edited, packed_params, masks, workspace) + sampling_launches(
        edited, packed_params, rng_state([1, 2, 3, 4]), window, count, tokens, workspace
    )
    run(launches)
    for row, p in enumerate(params):
        reference = apply_mask(apply_penalties(logits[row], p, histories[row]), masks[row])
        candidates, _, keep = filtered_candidates(reference, p)
        expected = {int(c) for c in candidates[:keep] if np.isfinite(reference[c])}
        assert int(tokens[row]) in expected, f"row {row}"
        assert allowed[row, tokens[row]]
    # Top-p's cut is exact: over the allowed ids' mass only, the kept set is sample_token's.
    candidates, _, keep = filtered_candidates(apply_mask(logits[1], masks[1]), params[1])
    threshold = max(workspace.radix_state[1, 0], workspace.radix_state[1, 4])
    assert set(np.flatnonzero(order_keys(edited[1]) >= threshold).tolist()) == set(candidates[:keep].tolist())


def test_the_mask_launcher_checks_its_mask() -> None:
    workspace = SamplingWorkspace.allocate(2, VOCAB, chunk=32)
    logits = np.zeros((2, VOCAB), np.float32)
    params = pack_params([SamplingParams()] * 2, 4)
    with pytest.raises(ValueError, match="mask"):
        mask_launches(logits, params, np.zeros((2, 2), np.uint32), workspace)
