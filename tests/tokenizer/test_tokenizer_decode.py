"""Decoding, one-shot and streamed: the text comes back (NFC) and streams never break UTF-8."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_corpus import CORPUS

from cmpchat.tokenizer import Tokenizer, bytes_to_unicode


def byte_token(tokenizer: Tokenizer, value: int) -> int:
    """Id of the single-byte token for `value`."""
    return piece_token(tokenizer, bytes_to_unicode()[value])


def piece_token(tokenizer: Tokenizer, piece: str) -> int:
    """Id of the vocabulary entry `piece`."""
    token_id = tokenizer.token_to_id(piece)
    assert token_id is not None, piece
    return token_id


def assert_streams_cleanly(tokenizer: Tokenizer, ids: list[int]) -> None:
    """Feed `ids` one by one: after every token the text so far is exactly the complete characters
    of the bytes so far (at most 3 bytes held back), and the pieces add up to `decode(ids)`."""
    decoder = tokenizer.stream_decoder()
    emitted = bytearray()
    fed = bytearray()
    pieces = []
    for token_id in ids:
        piece = decoder.feed(token_id)
        pieces.append(piece)
        emitted += piece.encode("utf-8")
        fed += tokenizer.token_bytes(token_id)
        assert "\ufffd" not in piece
        assert fed.startswith(emitted) and len(fed) - len(emitted) <= 3
    pieces.append(decoder.flush())
    assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_round_trips_and_streams(tokenizer: Tokenizer, name: str) -> None:
    text = CORPUS[name]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert_streams_cleanly(tokenizer, ids)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60))
def test_random_text_round_trips_and_streams(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert_streams_cleanly(tokenizer, ids)


def test_emoji_split_across_byte_tokens_waits_for_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = [byte_token(tokenizer, b) for b in "🦩".encode()]
    decoder = tokenizer.stream_decoder()
    assert [decoder.feed(i) for i in ids] == ["", "", "", "🦩"]
    assert decoder.flush() == ""


def test_special_tokens_stream_as_their_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    decoder = tokenizer.stream_decoder()
    assert decoder.feed(ids[0]) == "<|im_start|>"
    assert "".join(decoder.feed(i) for i in ids[1:]) + decoder.flush() == "assistant\n<think>\n"


def test_broken_tail_becomes_replacement_char_on_flush(tokenizer: Tokenizer) -> None:
    decoder = tokenizer.stream_decoder()
    assert decoder.feed(piece_token(tokenizer, "Hi")) == "Hi"
    assert decoder.feed(byte_token(tokenizer, 0xF0)) == ""
    assert decoder.feed(byte_token(tokenizer, 0x9F)) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.feed(piece_token(tokenizer, "ok")) == "ok"  # usable again after flush


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=248319), max_size=20))
def test_stream_of_arbitrary_ids_equals_decode(tokenizer: Tokenizer, ids: list[int]) -> None:
    decoder = tokenizer.stream_decoder()
    streamed = "".join(decoder.feed(i) for i in ids) + decoder.flush()
    assert streamed == tokenizer.decode(ids)


def test_padding_ids_decode_to_nothing(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode([tokenizer.vocab_size - 1]) == ""


def test_negative_ids_are_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(IndexError):
        tokenizer.decode([1, -1])
    with pytest.raises(IndexError):
        tokenizer.stream_decoder().feed(-1)
