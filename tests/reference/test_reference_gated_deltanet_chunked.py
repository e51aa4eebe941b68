"""The chunked (WY / UT-transform) Gated DeltaNet against the token-by-token recurrence it rewrites.

float64: the two agree to rounding (~1e-15 relative; asserted at 1e-10). float32: both are evaluated against a
float64 run of the recurrence, and the chunked form must stay within 4x the recurrence's own fp32 error (plus a
1e-7 floor): the chunked form only sums the same products in another order (dot products over dk and over the
chunk instead of one token after another), so its rounding error is of the recurrence's order; measured, it is
0.3-2.5x (the most with strongly correlated keys, where I + A is least well conditioned).
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import DTypeLike

from cmpchat.backends.reference.gated_deltanet import RecurrentState
from cmpchat.backends.reference.gated_deltanet_chunked import (
    chunked_gated_delta_rule,
    cumulative_log_decay,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
    value_head_keys,
)
from cmpchat.backends.reference.layers import l2_normalize, rms_norm, sigmoid, silu, softplus
from tests.kernels.test_gated_deltanet import Layer, gdn_config

Inputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""q, k, v, g, beta and the state: the arguments of both rules, in order."""


def in_dtype(inputs: Inputs, dtype: DTypeLike) -> Inputs:
    q, k, v, g, beta, state = (np.asarray(x, dtype=dtype) for x in inputs)
    return q, k, v, g, beta, state


def random_inputs(
    rng: np.random.Generator,
    steps: int,
    num_k_heads: int = 2,
    num_v_heads: int = 6,
    k_dim: int = 16,
    v_dim: int = 8,
    *,
    log_decay_range: tuple[float, float] = (-6.0, 1.0),
    key_correlation: float = 0.0,
    dtype: type = np.float64,
) -> Inputs:
    """q, k (L2-normalised, q scaled), v, g (= -e^u, u uniform in `log_decay_range`), beta, a nonzero state."""
    q = l2_normalize(rng.standard_normal((steps, num_k_heads, k_dim))) * k_dim**-0.5
    shared = rng.standard_normal((1, num_k_heads, k_dim))
    k = l2_normalize(
        key_correlation * shared + (1 - key_correlation) * rng.standard_normal((steps, num_k_heads, k_dim))
    )
    v = rng.standard_normal((steps, num_v_heads, v_dim))
    g = -np.exp(rng.uniform(*log_decay_range, (steps, num_v_heads)))
    beta = sigmoid(2 * rng.standard_normal((steps, num_v_heads)))
    state = 0.3 * rng.standard_normal((num_v_heads, k_dim, v_dim))
    return in_dtype((q, k, v, g, beta, state), dtype)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Normwise: the largest error over the largest magnitude."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300))


@pytest.mark.parametrize("steps", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_float64_equals_the_recurrence(steps: int, chunk: int) -> None:
    rng = np.random.default_rng(steps * 100 + chunk)
    inputs = random_inputs(rng, steps)
    expected_out, expected_state = recurrent_gated_delta_rule(*inputs)
    out, state = chunked_gated_delta_rule(*inputs, chunk=chunk)
    assert out.shape == expected_out.shape and out.dtype == np.float64
    assert relative_error(out, expected_out) < 1e-10
    assert relative_error(state, expected_state) < 1e-10


def test_a_chunk_longer_than_the_prompt_and_the_default_chunk() -> None:
    inputs = random_inputs(np.random.default_rng(1), 40)
    expected_out, expected_state = recurrent_gated_delta_rule(*inputs)
    for chunk in (64, 1000):
        out, state = chunked_gated_delta_rule(*inputs, chunk=chunk)
        assert relative_error(out, expected_out) < 1e-10 and relative_error(state, expected_state) < 1e-10
    out, _ = chunked_gated_delta_rule(*inputs)
    assert relative_error(out, expected_out) < 1e-10


@pytest.mark.parametrize(
    "log_decay_range, key_correlation",
    [((-6.0, 1.0), 0.0), ((-9.0, -4.0), 0.99), ((2.0, 9.0), 0.0), ((-8.0, 9.0), 0.5)],
    ids=["typical", "slow-decay-correlated-keys", "strong-decay", "mixed"],
)
@pytest.mark.parametrize("steps, chunk", [(200, 64), (130, 16)])
def test_float32_is_as_accurate_as_the_recurrence(
    log_decay_range: tuple[float, float], key_correlation: float, steps: int, chunk: int
) -> None:
    rng = np.random.default_rng(7)
    inputs = random_inputs(rng, steps, 2, 4, 128, 128, log_decay_range=log_decay_range, key_correlation=key_correlation)
    true_out, true_state = recurrent_gated_delta_rule(*inputs)
    single = in_dtype(inputs, np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine; overflow is not
        token_out, token_state = recurrent_gated_delta_rule(*single)
        out, state = chunked_gated_delta_rule(*single, chunk=chunk)
    assert out.dtype == np.float32 and state.dtype == np.float32
    for got, reference, truth in ((out, token_out, true_out), (state, token_state, true_state)):
        assert relative_error(got, truth) <= 4 * relative_error(reference, truth) + 1e-7


def test_strong_decays_never_overflow_and_cut_the_past() -> None:
    """Cumulative log decays of -1e5 per chunk: e^-gamma would overflow any float; the chunked form never
    forms it. A decay that rounds to zero leaves the state exactly as the tokens after it make it."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta, state = random_inputs(rng, 150, log_decay_range=(7.0, 8.0), dtype=np.float32)
    assert g.sum(axis=0).max() < -1e5
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=64)
        expected_out, expected_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert np.isfinite(out).all() and np.isfinite(final).all()
    assert relative_error(out, expected_out) < 1e-5 and relative_error(final, expected_final) < 1e-5
    # With every alpha = 0 each token sees only itself: S_t = k_t (beta_t v_t)^T.
    mapped_k, mapped_q = value_head_keys(k, 6), value_head_keys(q, 6)
    last = np.einsum("hk,hv->hkv", mapped_k[-1], beta[-1][:, None] * v[-1])
    np.testing.assert_allclose(final, last, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out[-1], np.einsum("hkv,hk->hv", last, mapped_q[-1]), rtol=1e-5, atol=1e-7)


def test_a_reset_token_early_in_a_chunk_keeps_the_later_tokens_precise() -> None:
    """One token with g = -300 then slow decay: a plain fp32 cumsum would leave gamma_i - gamma_j of the later
    tokens with ~2e-5 absolute error (output error ~2.5e-4); the compensated sums keep it at rounding level."""
    rng = np.random.default_rng(2)
    q, k, v, g, beta, state = random_inputs(rng, 64, 4, 4, 64, 64)
    g[:] = -0.01
    g[0], g[20] = -300.0, -1000.0
    true_out, true_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    single = in_dtype((q, k, v, g, beta, state), np.float32)
    out, final = chunked_gated_delta_rule(*single, chunk=64)
    assert relative_error(out, true_out) < 2e-6 and relative_error(final, true_state) < 2e-6


def test_compensated_cumulative_sums() -> None:
    g = np.array([[-300.0] + [-0.01] * 9], dtype=np.float32)
    hi, lo = cumulative_log_decay(g)
    exact = np.cumsum(g.astype(np.float64), axis=1)
    np.testing.assert_allclose(hi.astype(np.float64) + lo, exact, rtol=0, atol=1e-9)
    gaps = (hi[0, 9] - hi[0, 1]) + (lo[0, 9] - lo[0, 1])
    assert abs(float(gaps) - (-0.08)) < 1e-8


def test_unit_lower_inverse() -> None:
    rng = np.random.default_rng(4)
    a = np.tril(rng.standard_normal((3, 9, 9)), -1)
    t = unit_lower_inverse(a)
    np.testing.assert_allclose((np.eye(9) + a) @ t, np.broadcast_to(np.eye(9), (3, 9, 9)), atol=1e-12)


def test_value_heads_read_key_head_h_mod_hk() -> None:
    """Each value head equals a one-head run on key head h % Hk (GGUF order, not h // (Hv/Hk))."""
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(5), 70, num_k_heads=2, num_v_heads=6)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=16)
    for h in range(6):
        one = slice(h, h + 1)
        kh = slice(h % 2, h % 2 + 1)
        expected_out, expected_state = recurrent_gated_delta_rule(
            q[:, kh], k[:, kh], v[:, one], g[:, one], beta[:, one], state[one]
        )
        assert relative_error(out[:, one], expected_out) < 1e-10
        assert relative_error(final[one], expected_state) < 1e-10


def test_inputs_are_not_modified() -> None:
    inputs = random_inputs(np.random.default_rng(6), 20)
    copies = [x.copy() for x in inputs]
    chunked_gated_delta_rule(*inputs, chunk=8)
    recurrent_gated_delta_rule(*inputs)
    for x, before in zip(inputs, copies, strict=True):
        np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="chunk"):
        chunked_gated_delta_rule(*inputs, chunk=0)
    with pytest.raises(ValueError, match="multiple"):
        value_head_keys(inputs[0], 5)


def test_the_recurrence_is_the_reference_layers() -> None:
    """`recurrent_gated_delta_rule` fed as `GatedDeltaNet.__call__` feeds its loop gives that layer's output:
    the conventions (decay before the read, head mapping, state layout) are the reference layer's."""
    rng = np.random.default_rng(8)
    config = gdn_config(num_k_heads=2, num_v_heads=4, k_head_dim=32, v_head_dim=32)
    layer = Layer.random(config, rng)
    reference, shape = layer.reference, layer.shape
    projection = rng.standard_normal((37, shape.projection_width)).astype(np.float32)
    start = RecurrentState(
        (0.3 * rng.standard_normal((3, shape.conv_dim))).astype(np.float32),
        (0.3 * rng.standard_normal((4, 32, 32))).astype(np.float32),
    )
    layer_state = start.copy()
    expected = reference(projection, layer_state)

    mixed = reference._causal_conv(projection[:, : shape.conv_dim], start.copy())
    q_end = 2 * 32
    q = l2_normalize(mixed[:, :q_end].reshape(37, 2, 32)) * np.float32(32**-0.5)
    k = l2_normalize(mixed[:, q_end : 2 * q_end].reshape(37, 2, 32))
    v = mixed[:, 2 * q_end :].reshape(37, 4, 32)
    b0 = shape.conv_dim + shape.output_width
    beta = sigmoid(projection[:, b0 : b0 + 4])
    g = reference.a * softplus(projection[:, b0 + 4 :] + reference.dt_bias)
    z = projection[:, shape.conv_dim : b0].reshape(37, 4, 32)
    for rule in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        out, final = rule(q, k, v, g, beta, start.delta)
        gated = (rms_norm(out, reference.norm_weight, config.rms_eps) * silu(z)).reshape(37, -1)
        assert relative_error(gated, expected) < 1e-5
        assert relative_error(final, layer_state.delta) < 1e-5
