"""Perplexity over a text, and how far other engine configurations move the next-token distribution.

The text is cut into windows of `ctx` tokens; each window runs from a fresh sequence, its first half is
context and the rest is scored (as llama.cpp's `llama-perplexity` does). Every configuration sees the same
windows; per scored token only the KL divergence, the two top-1 choices and the log-likelihoods are kept,
never the logits of more than one window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cmpchat import Model
from cmpchat.errors import CmpchatError

ROWS = 64  # positions turned into log-probabilities at a time, to bound memory with large vocabularies
MIN_WINDOW = 16


@dataclass(frozen=True, slots=True)
class Divergence:
    """One configuration against the base on the same scored tokens."""

    perplexity: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class TextScore:
    tokens: int
    windows: int
    window_tokens: int
    scored_tokens: int
    perplexity: float
    tests: dict[str, Divergence]

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "windows": self.windows,
            "window_tokens": self.window_tokens,
            "scored_tokens": self.scored_tokens,
            "perplexity": self.perplexity,
            "tests": {name: d.as_dict() for name, d in self.tests.items()},
        }


def windows(n_tokens: int, ctx: int, limit: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of each window: whole windows of ctx tokens, or the whole text when it is shorter."""
    if ctx < MIN_WINDOW:
        raise CmpchatError(f"the window must be at least {MIN_WINDOW} tokens, not {ctx}")
    if n_tokens < MIN_WINDOW:
        raise CmpchatError(f"the text has {n_tokens} tokens; at least {MIN_WINDOW} are needed")
    spans = [(s, s + ctx) for s in range(0, n_tokens - ctx + 1, ctx)] or [(0, n_tokens)]
    return spans[:limit] if limit else spans


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def score_text(
    base: Model,
    tests: Mapping[str, Model],
    tokens: Sequence[int],
    ctx: int,
    *,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> TextScore:
    """Perplexity of `base` on `tokens`, and each test configuration's divergence from it."""
    spans = windows(len(tokens), ctx, max_windows)
    nll: list[np.ndarray] = []
    test_nll: dict[str, list[np.ndarray]] = {name: [] for name in tests}
    kl: dict[str, list[np.ndarray]] = {name: [] for name in tests}
    same: dict[str, list[np.ndarray]] = {name: [] for name in tests}
    for index, (start, end) in enumerate(spans):
        if progress is not None:
            progress("scoring the text", index, len(spans))
        window = list(tokens[start:end])
        first = len(window) // 2  # logits[i] predicts window[i + 1]; positions first.. are scored
        targets = np.asarray(window[first + 1 :])
        base_logits = base.logits(window)[first:-1]
        others = {name: model.logits(window)[first:-1] for name, model in tests.items()}
        for name, logits in others.items():
            if logits.shape != base_logits.shape:
                raise CmpchatError(
                    f"configuration '{name}' gives logits of shape {logits.shape[1:]} where the base gives "
                    f"{base_logits.shape[1:]}: the vocabularies differ"
                )
        for row in range(0, len(targets), ROWS):
            rows = slice(row, row + ROWS)
            lp_base = log_softmax(base_logits[rows])
            picked = np.arange(lp_base.shape[0]), targets[rows]
            nll.append(-lp_base[picked])
            for name, logits in others.items():
                lp_test = log_softmax(logits[rows])
                kl[name].append(np.maximum((np.exp(lp_base) * (lp_base - lp_test)).sum(axis=-1), 0.0))
                same[name].append(lp_base.argmax(axis=-1) == lp_test.argmax(axis=-1))
                test_nll[name].append(-lp_test[picked])
    if progress is not None:
        progress("scoring the text", len(spans), len(spans))
    all_nll = np.concatenate(nll)
    results = {}
    for name in tests:
        k = np.concatenate(kl[name])
        results[name] = Divergence(
            perplexity=float(np.exp(np.concatenate(test_nll[name]).mean())),
            kl_mean=float(k.mean()),
            kl_median=float(np.median(k)),
            kl_p99=float(np.percentile(k, 99)),
            kl_max=float(k.max()),
            top1_agreement=float(np.concatenate(same[name]).mean()),
        )
    return TextScore(
        tokens=len(tokens),
        windows=len(spans),
        window_tokens=spans[0][1] - spans[0][0],
        scored_tokens=len(all_nll),
        perplexity=float(np.exp(all_nll.mean())),
        tests=results,
    )
