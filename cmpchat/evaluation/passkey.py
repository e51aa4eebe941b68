"""The pass-key retrieval task, in one place for `cmpchat eval` and for training (training/train.py).

A prompt is an introduction, filler text with one pass-key sentence placed at a chosen depth, then a
question whose answer is the key. The task is assembled from separately tokenised pieces, so a prompt of
an exact token length can be built for any tokenizer, and the model sees in training exactly what it is
tested on. This module needs only the standard library: the training script loads it by path.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it at the end.\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}."
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_DIGITS = 5
ANSWER_TOKENS_CHECKED = 1 + KEY_DIGITS
"""Greedy answer tokens that decide a trial: the space and one token per digit (digits split one by one)."""

Encode = Callable[[str], list[int]]


def make_key(rng: random.Random) -> str:
    return str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))


def fixed_length(encode: Encode) -> int:
    """Tokens of a prompt that are not filler (the key's digits are one token each)."""
    key = "1" * KEY_DIGITS
    return len(encode(INTRO)) + len(encode(NEEDLE.format(key=key))) + len(encode(QUESTION))


def build_prompt(
    encode: Encode,
    length: int,
    depth: float,
    key: str,
    filler: Sequence[int] | None = None,
) -> list[int]:
    """Token ids of a prompt of exactly `length` tokens with the key's sentence after `depth` (0..1) of the
    filler. `filler` is the filler's token ids, cycled as needed (default: FILLER repeated)."""
    intro, needle, question = encode(INTRO), encode(NEEDLE.format(key=key)), encode(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"a pass-key prompt needs at least {length - room} tokens, not {length}")
    unit = list(filler) if filler is not None else encode(FILLER)
    if not unit:
        raise ValueError("the filler is empty")
    repeats = -(-room // len(unit))
    body = (unit * repeats)[:room]
    cut = round(depth * room)
    return intro + body[:cut] + needle + body[cut:] + question


def answer_ids(encode: Encode, key: str) -> list[int]:
    return encode(ANSWER.format(key=key))


def recalled(text: str, key: str) -> bool:
    """Whether a continuation of the question gives the key (the first run of digits, nothing else)."""
    match = re.match(r"\s*(\d+)", text)
    return match is not None and match.group(1) == key
