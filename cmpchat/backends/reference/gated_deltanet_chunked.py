"""Gated DeltaNet over a whole prompt in chunks: the WY (UT-transform) form of the recurrence (docs/model.md
"Gated DeltaNet layer"), exact against the token-by-token rule it rewrites.

The recurrence per value head, with state S [dk, dv] (row index = key dim), log decay g_t <= 0, alpha_t = e^g_t:

    S' = alpha_t S;  delta_t = beta_t (v_t - S'^T k_t);  S = S' + k_t delta_t^T;  o_t = S^T q_t

Within a chunk of L tokens starting from state S_0, let gamma_i = g_1 + ... + g_i (positions 1..L of the
chunk). Unrolling gives S_i = e^gamma_i S_0 + sum_{j<=i} e^(gamma_i - gamma_j) k_j delta_j^T, and so

    delta_i + beta_i sum_{j<i} e^(gamma_i - gamma_j) (k_i . k_j) delta_j = beta_i v_i - beta_i e^gamma_i S_0^T k_i

i.e. (I + A) Delta = diag(beta) V - diag(beta e^gamma) K S_0 with A strictly lower triangular,
A_ij = beta_i e^(gamma_i - gamma_j) k_i . k_j. With T = (I + A)^-1 (forward substitution: the UT transform)
the WY factors W = T diag(beta e^gamma) K and U = T diag(beta) V give every token's delta at once:

    Delta = U - W S_0
    O     = diag(e^gamma) Q S_0 + (M o Q K^T) Delta,        M_ij = e^(gamma_i - gamma_j) for j <= i, else 0
    S_L   = e^gamma_L S_0 + K^T diag(e^(gamma_L - gamma)) Delta

Numerical safety: every exponent used is a sum of g's over a stretch of the chunk, so it is <= 0 (exp may
underflow to 0, which is the right answer, but never overflows); no e^-gamma is ever formed. Differences
gamma_i - gamma_j are taken from compensated cumulative sums (hi + lo, Knuth's two-sum), so one strongly
decaying token early in a chunk does not cost the tokens after it their precision (a plain fp32 cumsum of
-200 then -0.01s would leave the later differences with ~1e-5 absolute error). The CUDA kernels
(`cmpchat.kernels.gated_deltanet_chunked`) do the same in fp32.

Inputs are what `GatedDeltaNet.__call__` feeds its loop: q, k after the conv, SiLU and L2 normalisation
(q scaled by dk^-1/2) per key head, v per value head, g = ssm_a * softplus(a + dt_bias) and
beta = sigmoid(b) per value head. Value head h reads key head h % Hk (the GGUF order).
"""

from __future__ import annotations

import numpy as np

DEFAULT_CHUNK = 64


def value_head_keys(x: np.ndarray, num_v_heads: int) -> np.ndarray:
    """q or k [T, Hk, dk] as seen by each value head [T, Hv, dk]: value head h reads key head h % Hk."""
    num_k_heads = x.shape[1]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
    return x[:, np.arange(num_v_heads) % num_k_heads]


def recurrent_gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The token-by-token rule, in the arithmetic of `GatedDeltaNet.__call__`: outputs [T, Hv, dv], final state.

    q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] (not modified). Computes in the
    inputs' common dtype.
    """
    num_v_heads = v.shape[1]
    q, k = value_head_keys(q, num_v_heads), value_head_keys(k, num_v_heads)
    dtype = np.result_type(q, k, v, g, beta, state)
    decay = np.exp(g.astype(dtype))  # alpha = exp(g)
    s = state.astype(dtype, copy=True)
    out = np.empty(v.shape, dtype=dtype)
    for t in range(v.shape[0]):
        s = s * decay[t][:, None, None]
        u = np.einsum("hkv,hk->hv", s, k[t])  # read with the already-decayed state
        delta = beta[t][:, None] * (v[t] - u)
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def cumulative_log_decay(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive cumulative sums of g [H, L] along the chunk as hi + lo (compensated: Knuth's two-sum).

    hi is the running sum as rounded; lo collects each addition's rounding error, so
    (hi_i - hi_j) + (lo_i - lo_j) is gamma_i - gamma_j to within a rounding of the difference itself.
    """
    hi = np.empty_like(g)
    lo = np.empty_like(g)
    total = np.zeros(g.shape[0], dtype=g.dtype)
    error = np.zeros(g.shape[0], dtype=g.dtype)
    for i in range(g.shape[1]):
        addend = g[:, i]
        new_total = total + addend
        addend_part = new_total - total
        error = error + ((total - (new_total - addend_part)) + (addend - addend_part))
        total = new_total
        hi[:, i] = total
        lo[:, i] = error
    return hi, lo


def unit_lower_inverse(a: np.ndarray) -> np.ndarray:
    """(I + A)^-1 for strictly lower triangular A [H, L, L], by forward substitution (row by row)."""
    length = a.shape[-1]
    identity = np.eye(length, dtype=a.dtype)
    t = np.zeros_like(a)
    for i in range(length):  # row i of T: e_i - sum_{m<i} A_im T_m
        t[:, i, :] = identity[i] - np.einsum("hm,hmc->hc", a[:, i, :i], t[:, :i, :])
    return t


def chunked_gated_delta_rule(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """The same result as `recurrent_gated_delta_rule`, `chunk` tokens at a time (module docstring).

    q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] (not modified). Returns outputs
    [T, Hv, dv] and the final state, in the inputs' common dtype.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    steps, num_v_heads, v_dim = v.shape
    dtype = np.result_type(q, k, v, g, beta, state)
    # Head-major working copies: [Hv, T, d] and [Hv, T].
    q = value_head_keys(q, num_v_heads).transpose(1, 0, 2).astype(dtype)
    k = value_head_keys(k, num_v_heads).transpose(1, 0, 2).astype(dtype)
    v = v.transpose(1, 0, 2).astype(dtype)
    g = g.T.astype(dtype)
    beta = beta.T.astype(dtype)
    s = state.astype(dtype, copy=True)
    out = np.empty((num_v_heads, steps, v_dim), dtype=dtype)

    for start in range(0, steps, chunk):
        rows = slice(start, min(start + chunk, steps))
        qc, kc, vc, gc, bc = q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows]
        length = gc.shape[1]
        hi, lo = cumulative_log_decay(gc)
        causal = np.tril(np.ones((length, length), dtype=bool))
        strictly_causal = np.tril(causal, -1)
        gap = (hi[:, :, None] - hi[:, None, :]) + (lo[:, :, None] - lo[:, None, :])  # gamma_i - gamma_j
        decay = np.where(causal, np.exp(np.where(causal, gap, 0)), 0).astype(dtype)  # exponents <= 0 only
        decay_in = np.exp(hi + lo)  # e^gamma_i: from the chunk's start to token i
        decay_out = np.exp((hi[:, -1:] - hi) + (lo[:, -1:] - lo))  # e^(gamma_L - gamma_i): token i to the end

        kk = kc @ kc.transpose(0, 2, 1)
        a = np.where(strictly_causal, bc[:, :, None] * decay * kk, 0).astype(dtype)
        t = unit_lower_inverse(a)
        w = t @ ((bc * decay_in)[:, :, None] * kc)  # [Hv, L, dk]
        u = t @ (bc[:, :, None] * vc)  # [Hv, L, dv]

        delta = u - w @ s  # every token's delta_i
        qk = decay * (qc @ kc.transpose(0, 2, 1))
        out[:, rows] = decay_in[:, :, None] * (qc @ s) + qk @ delta
        s = decay_in[:, -1, None, None] * s + kc.transpose(0, 2, 1) @ (decay_out[:, :, None] * delta)
    return out.transpose(1, 0, 2), s
