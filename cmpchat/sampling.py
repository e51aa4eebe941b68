"""Next-token selection from logits: penalties, an allowed-token mask, temperature, top-k, top-p, min-p,
seeded draws; and the log-probabilities a front end may report.

Order of operations: penalties on the raw logits, then the mask (a grammar's disallowed tokens to -inf),
then temperature, then the top-k, top-p and min-p filters on the tempered distribution, then one draw.
Temperature 0 is greedy (argmax after penalties and mask). Log-probabilities are those of the raw logits
(before penalties, mask and temperature), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy (stored as 0): the distribution is already a point mass for any logit
gap above ~1e-3, and logits / T would overflow float32 (inf - inf = NaN) soon below it."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to choose each next token; the defaults are greedy decoding with no penalties."""

    temperature: float = 0.0
    """0 (or anything under GREEDY_BELOW) picks the most likely token; higher values flatten the distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probabilities sum to at least p (1 = all)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0 = none)."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of recently seen tokens by this (1 = off)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every recently seen token."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each recently seen token."""
    penalty_window: int = 64
    """How many of the latest context tokens the three penalties look at."""
    seed: int | None = None
    """Seed for the draws, so a sampled reply can be reproduced."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ValueError("temperature must be >= 0")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.penalty_window < 0:
            raise ValueError("penalty_window must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """Logits with the repetition, presence and frequency penalties of the last `penalty_window` tokens."""
    if not params.has_penalties or params.penalty_window == 0 or len(history) == 0:
        return logits
    recent = np.asarray(history[-params.penalty_window :], dtype=np.int64)
    tokens, counts = np.unique(recent, return_counts=True)
    out = logits.astype(np.float32, copy=True)
    seen = out[tokens]
    if params.repetition_penalty != 1.0:
        seen = np.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
    seen = seen - params.presence_penalty - params.frequency_penalty * counts
    out[tokens] = seen
    return out


def mask_words(vocab: int) -> int:
    """uint32 words of an allowed-token mask over `vocab` ids."""
    return (vocab + 31) // 32


def allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab]: the ids a packed mask allows (bit i % 32 of word i // 32, llguidance's layout); ids past the
    mask's end (padding rows of an LM head wider than the tokenizer) are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<u4").view(np.uint8), bitorder="little")
    allowed = np.zeros(vocab, bool)
    covered = min(vocab, bits.shape[0])
    allowed[:covered] = bits[:covered]
    return allowed


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits with every id the packed mask does not allow at -inf."""
    out = logits.astype(np.float32, copy=True)
    out[~allowed_ids(mask, out.shape[0])] = -np.inf
    return out


def sample_token(
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int],
    rng: np.random.Generator,
    allowed: np.ndarray | None = None,
) -> int:
    """One token id from a [vocab] row of logits; `allowed` is a packed mask (uint32 [mask_words(vocab)]) of
    the ids that may be chosen, None for all."""
    logits = apply_penalties(np.asarray(logits, dtype=np.float32), params, history)
    if allowed is not None:
        logits = apply_mask(logits, allowed)
    if params.is_greedy:
        return int(np.argmax(logits))
    candidates, probs, keep = filtered_candidates(logits, params)
    probs = probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(keep, p=probs)])


def filtered_candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray, int]:
    """The sampled path's filter chain on (already penalised) logits: the candidate ids sorted by
    probability, most likely first, their probabilities after temperature and top-k, and how many of them
    top-p and min-p keep."""
    candidates = np.arange(logits.shape[0])
    scaled = logits / np.float32(params.temperature)
    if 0 < params.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]
    weights = scaled[candidates].astype(np.float64)
    probs = np.exp(weights - weights[0])
    probs /= probs.sum()
    keep = probs.shape[0]
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    return candidates, probs, keep


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of a chosen token and of the most likely ones, from the raw logits."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(id, log-probability) of the most likely tokens, most likely first (ties to the lower id)."""


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """Log-softmax of a [vocab] row of raw logits at `token`, and its `top` most likely entries."""
    row = np.asarray(logits, dtype=np.float64)
    peak = np.max(row)
    logprobs = row - (peak + np.log(np.sum(np.exp(row - peak))))
    top = min(top, row.shape[0])
    candidates = np.argpartition(-logprobs, top - 1)[:top] if top > 0 else np.zeros(0, np.int64)
    best = candidates[np.lexsort((candidates, -logprobs[candidates]))]
    return TokenLogprobs(int(token), float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in best))
