"""Constrained decoding: a grammar (llguidance's: a JSON schema or Lark text compiled to its grammar form) turned,
token by token, into the mask of ids that may come next.

Per constrained reply a `GrammarMatcher` follows the tokens it accepts and, before each selection, computes the
packed allowed-token mask (uint32 [ceil(vocab / 32)], the layout the samplers apply). The host does this after
reading the previous token and while the next decode step runs, so it costs the GPU nothing; an unconstrained
reply has no matcher and pays nothing. When the grammar is complete the mask allows only end tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import llguidance
import numpy as np

from cmpchat.errors import CmpchatError
from cmpchat.sampling import mask_words
from cmpchat.tokenizer import Tokenizer


class GrammarError(CmpchatError):
    """A grammar (or the schema it came from) that cannot be compiled."""


class _TokenTable:
    """The tokenizer as llguidance's `TokenizerWrapper` reads it: each id's bytes, the end and special ids, and
    encoding."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper tries bytes first; text it is then
            raise TypeError("text only")
        return self._tokenizer.encode(text, parse_special=False)


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer) -> Any:
    """llguidance's view of `tokenizer` (its token trie), built once per tokenizer: about a second at
    Qwen's 248k ids."""
    ends = sorted(tokenizer.eos_token_ids)
    table = llguidance.TokenizerWrapper(_TokenTable(tokenizer))
    return llguidance.LLTokenizer(table, n_vocab=tokenizer.vocab_size, eos_token=ends)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that a JSON schema validates, written compactly (no optional whitespace, which a
    weak model would otherwise fill with newlines)."""
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    except ValueError as err:
        raise GrammarError(f"the JSON schema cannot be read: {err}") from None


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: `%json {...}` embeds a JSON schema)."""
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def check_grammar(grammar: str, tokenizer: Tokenizer) -> None:
    """Raise `GrammarError` with llguidance's one-line reason when `grammar` cannot be compiled."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer(tokenizer))
    if is_error:
        raise GrammarError(_first_line(messages[0]))


class GrammarMatcher:
    """The state of one reply's grammar: what may follow the tokens accepted so far."""

    def __init__(self, grammar: str, tokenizer: Tokenizer) -> None:
        self._matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), grammar, log_level=0)
        self._check()
        self._words = mask_words(tokenizer.vocab_size)

    def allowed(self) -> np.ndarray:
        """The packed mask of the ids that may come next (uint32 [ceil(vocab / 32)])."""
        mask = np.frombuffer(self._matcher.compute_bitmask(), dtype="<u4")[: self._words]
        self._check()
        return mask.astype(np.uint32)

    def accept(self, token: int) -> None:
        """Follow the chosen token (one the last mask allowed)."""
        self._matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self._matcher.get_error())}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown grammar error"
