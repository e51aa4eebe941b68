"""Pass-key retrieval accuracy by context length and depth (the task itself is in passkey.py).

Each trial builds a prompt of exactly the cell's length with a fresh random key at the cell's depth,
decodes greedily a few tokens and counts the trial as passed when the continuation starts with the key.
Keys come from a seeded generator per (length, depth, trial), so runs and configurations are comparable.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cmpchat import Finished, GenerationOptions, Model, SamplingParams
from cmpchat.errors import CmpchatError
from cmpchat.evaluation import passkey

DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FIRST_LENGTH = 1024
MIN_TRIALS = 20


def lengths_up_to(limit: int) -> list[int]:
    """1K, 2K, 4K, ... up to `limit`, and `limit` itself."""
    if limit < FIRST_LENGTH:
        return [limit]
    out = []
    n = FIRST_LENGTH
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


@dataclass(frozen=True, slots=True)
class NeedleGrid:
    lengths: list[int]
    depths: list[float]
    trials: int
    accuracy: list[list[float]]
    """accuracy[i][j]: fraction of trials passed at lengths[i], depths[j]."""

    def as_dict(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "trials": self.trials, "accuracy": self.accuracy}

    def longest_at(self, threshold: float) -> int | None:
        """The longest length up to which every cell of every length reaches `threshold`."""
        best = None
        for length, row in zip(self.lengths, self.accuracy):
            if min(row) < threshold:
                break
            best = length
        return best


def trial_key(seed: int, length: int, depth: float, trial: int) -> str:
    return passkey.make_key(random.Random(f"{seed}/{length}/{depth:.3f}/{trial}"))


def run_trial(model: Model, length: int, depth: float, key: str) -> bool:
    prompt = passkey.build_prompt(model.tokenize, length, depth, key)
    options = GenerationOptions(max_tokens=passkey.ANSWER_TOKENS_CHECKED + 1, sampling=SamplingParams(temperature=0.0))
    content = ""
    for event in model.generate(prompt, options):
        if isinstance(event, Finished):
            content = event.content
    return passkey.recalled(content, key)


def needle_grid(
    model: Model,
    lengths: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    trials: int = MIN_TRIALS,
    *,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> NeedleGrid:
    if trials < 1:
        raise CmpchatError("--trials must be at least 1")
    shortest = passkey.fixed_length(model.tokenize) + 1
    for length in lengths:
        if length < shortest:
            raise CmpchatError(f"a pass-key prompt needs at least {shortest} tokens; {length} is too short")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise CmpchatError(f"depth {depth:g} is outside 0..1 (give depths in percent, 0 to 100)")
    total = len(lengths) * len(depths) * trials
    done = 0
    accuracy = []
    for length in lengths:
        row = []
        for depth in depths:
            passed = 0
            for trial in range(trials):
                if progress is not None:
                    progress(f"pass key at {length} tokens", done, total)
                passed += run_trial(model, length, depth, trial_key(seed, length, depth, trial))
                done += 1
            row.append(passed / trials)
        accuracy.append(row)
    if progress is not None:
        progress("pass key", total, total)
    return NeedleGrid(list(lengths), list(depths), trials, accuracy)
