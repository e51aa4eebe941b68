"""Sampling: greedy, filters, penalties and seeds."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.sampling import SamplingParams, apply_penalties, sample_token

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))


def draws(params: SamplingParams, n: int = 2000, logits: np.ndarray = LOGITS, history=()) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.array([sample_token(logits, params, list(history), rng) for _ in range(n)])


def test_greedy_is_argmax():
    assert sample_token(LOGITS, SamplingParams(), [], np.random.default_rng()) == 0


@pytest.mark.parametrize("temperature", [2.6e-68, 1e-45, 1e-30, 9e-6])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    """Found by the server's fuzz test: 2.6e-68 is 0 in float32, and logits / 0 made the draw NaN."""
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and params.temperature == 0.0
    wide = np.array([-3e4, 2e4, 1e4, 0.0], np.float32)
    assert sample_token(wide, params, [], np.random.default_rng()) == 1
    assert not SamplingParams(temperature=1e-5).is_greedy
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draws(SamplingParams(temperature=1.0)), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.1], atol=0.04)


def test_top_k_top_p_min_p_restrict_the_candidates():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7))) == {0, 1}  # 0.5 + 0.25 >= 0.7
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) == {0}
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3))) == {0, 1}  # >= 0.15


def test_seed_reproduces_a_sample():
    params = SamplingParams(temperature=1.0, seed=5)
    first = [sample_token(LOGITS, params, [], np.random.default_rng(params.seed)) for _ in range(1)]
    again = [sample_token(LOGITS, params, [], np.random.default_rng(params.seed)) for _ in range(1)]
    assert first == again


def test_penalties():
    logits = np.array([2.0, -1.0, 0.5], dtype=np.float32)
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0, 1, 1])
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5])
    out = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 1, 0])
    np.testing.assert_allclose(out, [2.0 - 0.5 - 0.25, -1.0 - 0.5 - 0.5, 0.5])
    # Only the last `penalty_window` tokens count.
    out = apply_penalties(logits, SamplingParams(presence_penalty=1.0, penalty_window=1), [0, 2])
    np.testing.assert_allclose(out, [2.0, -1.0, -0.5])
    # A penalty can change the greedy choice.
    assert sample_token(logits, SamplingParams(presence_penalty=3.0), [0], np.random.default_rng()) == 2


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(min_p=2.0), dict(repetition_penalty=0.0)],
)
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_mask_limits_greedy_and_sampled_choices_to_its_ids():
    from cmpchat.sampling import apply_mask, mask_words

    mask = np.zeros(mask_words(4), np.uint32)
    mask[0] = 0b1010  # ids 1 and 3
    assert sample_token(LOGITS, SamplingParams(), [], np.random.default_rng(), mask) == 1
    drawn = {
        sample_token(LOGITS, SamplingParams(temperature=1.0), [], np.random.default_rng(i), mask) for i in range(200)
    }
    assert drawn == {1, 3}
    np.testing.assert_array_equal(apply_mask(LOGITS, mask)[[0, 2]], [-np.inf, -np.inf])


def test_ids_past_a_short_mask_are_not_allowed():
    """An LM head wider than the tokenizer (padding rows): the grammar's mask covers the tokenizer's ids only."""
    from cmpchat.sampling import allowed_ids

    mask = np.array([0xFFFFFFFF], np.uint32)
    assert allowed_ids(mask, 40).tolist() == [True] * 32 + [False] * 8
