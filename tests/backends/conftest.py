"""Fixtures of the backend tests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cmpchat.chat.template import builtin_template
from cmpchat.model.builder import build_model
from tests.conftest import TINY_SHAPE, add_byte_vocabulary


@pytest.fixture(scope="session")
def two_layer_model(tmp_path_factory):
    """The tiny model cut to two layers (a Gated DeltaNet layer, then an attention layer): simulator tests of
    the CUDA backend take seconds a layer."""
    path = tmp_path_factory.mktemp("two-layers") / "two-layers.gguf"
    shape = replace(TINY_SHAPE, name="tiny-two-layers", num_layers=2)
    build_model(path, shape, add_tokenizer=add_byte_vocabulary, chat_template=builtin_template(), seed=7)
    return path
