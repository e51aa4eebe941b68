"""Servers for the protocol tests: one over the scripted backend, one over the tiny random model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cmpchat.api import Model, open_model
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.server.settings import ServerSettings
from cmpchat.tokenizer import Tokenizer
from tests.scripted_backend import ScriptedBackend
from tests.server.live import LiveServer, live_server

API_KEY = "test-key"


def scripted_model(path: Path, *, step_delay: float = 0.0) -> Model:
    model_file = ModelFile(path)
    backend = ScriptedBackend(
        ModelConfig.from_model_file(model_file), Tokenizer.from_metadata(model_file.metadata), step_delay=step_delay
    )
    return Model(model_file, backend)


def client_for(server: LiveServer, api_key: str = "unused", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=api_key, max_retries=0, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def scripted_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path)
    settings = ServerSettings(port=0, slots=4, max_request_bytes=64 * 1024, model_name="scripted")
    with live_server(settings, lambda: model) as server:
        server.model = model
        yield server


@pytest.fixture(scope="module")
def client(scripted_server: LiveServer) -> openai.OpenAI:
    return client_for(scripted_server)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(port=0, slots=4, prefill_chunk=32)
    with live_server(settings, lambda: open_model(tiny_model_path, sequences=4, cache_states=16)) as server:
        yield server
