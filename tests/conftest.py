"""Shared fixtures: a private cache folder (the demo model is built there, never in the user's cache)
and a tiny random model with a byte-level vocabulary for fast end-to-end tests."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from cmpchat.chat.template import builtin_template
from cmpchat.model.builder import ModelShape, build_model
from cmpchat.tokenizer import bytes_to_unicode

# Set before anything asks platformdirs for the cache, so no test touches the user's folders.
_TEST_HOME = Path(tempfile.mkdtemp(prefix="cmpchat-tests-"))
os.environ["XDG_CACHE_HOME"] = str(_TEST_HOME / "cache")
os.environ["XDG_DATA_HOME"] = str(_TEST_HOME / "data")
os.environ["XDG_CONFIG_HOME"] = str(_TEST_HOME / "config")


def pytest_configure(config: pytest.Config) -> None:
    """Kernel tests run under Numba's CUDA simulator unless GPU tests were asked for (`-m gpu`)."""
    selected = (config.getoption("-m") or "").replace("not gpu", "")
    if "gpu" not in selected:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from tests.simulator_barrier import install

        install()


@pytest.fixture(autouse=True)
def restore_interpreter_settings() -> Iterator[None]:
    """Loading a model in the app or a command freezes the process's objects (cmpchat.long_lived), and the
    app sets the GIL switch interval: both are put back after each test, so garbage a test leaves in
    cycles is still freed and the next test runs at the default interval."""
    interval = sys.getswitchinterval()
    yield
    gc.unfreeze()
    sys.setswitchinterval(interval)


TINY_MERGES = ["H e", "l l", "ll o"]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

TINY_SHAPE = ModelShape(
    "tiny",
    hidden_size=64,
    num_layers=4,
    ffn_size=96,
    num_heads=2,
    num_kv_heads=1,
    num_k_heads=2,
    num_v_heads=4,
    tied_embeddings=False,
    head_dim=32,
    k_head_dim=32,
    v_head_dim=32,
    rope_dims=16,
    rope_sections=(3, 3, 2, 0),
    full_attention_interval=2,
    context_length=4096,
    vocab_size=256 + len(TINY_MERGES) + len(TINY_SPECIALS),
)

WIDE_SHAPE = replace(TINY_SHAPE, name="tiny-wide", hidden_size=256, ffn_size=512)
"""The tiny model, wide enough for 256-value blocks (k-quants) in most matrices; attn_output and ssm_out (64 and
128 inputs) take 32-value types, as llama-quantize's fallbacks do."""


def add_byte_vocabulary(writer: gguf.GGUFWriter) -> None:
    """A gpt2 vocabulary of the 256 single bytes, three merges and a few special tokens."""
    byte_chars = bytes_to_unicode()
    merged = [merge.replace(" ", "") for merge in TINY_MERGES]
    tokens = [byte_chars[b] for b in range(256)] + merged + TINY_SPECIALS
    types = [gguf.TokenType.NORMAL] * (256 + len(merged)) + [gguf.TokenType.CONTROL] * len(TINY_SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    build_model(path, TINY_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=builtin_template(), seed=7)
    return path
