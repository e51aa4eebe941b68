"""Model files whose tokenizer cmpchat cannot run are refused with a one-line `CmpchatError`."""

from __future__ import annotations

from typing import Any

import gguf
import pytest

from cmpchat.errors import CmpchatError
from cmpchat.tokenizer import Tokenizer

KEYS = gguf.Keys.Tokenizer


def refusal(metadata: dict[str, Any]) -> str:
    with pytest.raises(CmpchatError) as excinfo:
        Tokenizer.from_metadata(metadata)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_unsupported_tokenizer_model(vocab_metadata: dict[str, Any]) -> None:
    message = refusal({**vocab_metadata, KEYS.MODEL: "llama"})
    assert message == "tokenizer 'llama' is not supported: cmpchat reads gpt2 BPE tokenizers (Qwen3.5/3.6 GGUF files)"


def test_unsupported_pre_tokenizer(vocab_metadata: dict[str, Any]) -> None:
    assert refusal({**vocab_metadata, KEYS.PRE: "llama-bpe"}).startswith("pre-tokenizer 'llama-bpe' is not supported")


def test_missing_pre_tokenizer(vocab_metadata: dict[str, Any]) -> None:
    metadata = {k: v for k, v in vocab_metadata.items() if k != KEYS.PRE}
    assert refusal(metadata).startswith("pre-tokenizer 'default' is not supported")


def test_file_without_tokenizer() -> None:
    assert "no tokenizer" in refusal({"general.architecture": "qwen35"})


def test_missing_merges(vocab_metadata: dict[str, Any]) -> None:
    metadata = {k: v for k, v in vocab_metadata.items() if k != KEYS.MERGES}
    assert "tokenizer.ggml.merges missing" in refusal(metadata)


def test_token_types_of_wrong_length(vocab_metadata: dict[str, Any]) -> None:
    metadata = {**vocab_metadata, KEYS.TOKEN_TYPE: vocab_metadata[KEYS.TOKEN_TYPE][:-1]}
    assert "248320 tokens but 248319 token types" in refusal(metadata)


def test_merge_of_unknown_tokens(vocab_metadata: dict[str, Any]) -> None:
    metadata = {**vocab_metadata, KEYS.MERGES: ["Ġ zzzzqqq", *vocab_metadata[KEYS.MERGES][:10]]}
    assert "tokenizer is broken" in refusal(metadata)
