"""The CUDA backend refuses, in one line and before it touches a GPU, a file it cannot run: here llama.cpp's
model stored as F32, whose float token embedding its lookup does not read (the CPU backend reads it); Q8_0 files
and the Q4_K_M mix as llama.cpp writes it (a Q4_K embedding) pass. test_kquant_weights.py has the other
refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmpchat.api import open_model
from cmpchat.backends.gpu import model as gpu_model
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.weights import check_gpu_types
from cmpchat.errors import CmpchatError
from cmpchat.model.builder import build_model
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from tests.conftest import WIDE_SHAPE, add_byte_vocabulary


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, as_f32=True)
    return path


@pytest.fixture
def no_gpu_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("the GPU was asked for before the file's types were checked")

    monkeypatch.setattr(gpu_model, "gpu_info", refuse)


def one_line(caught: pytest.ExceptionInfo[CmpchatError]) -> str:
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_refused_before_any_device_call_naming_the_tensor_and_its_type(float_path, no_gpu_calls):
    model_file = ModelFile(float_path)
    with pytest.raises(CmpchatError) as caught:
        CudaBackend(model_file)
    message = one_line(caught)
    assert "'token_embd.weight' is F32" in message
    assert "--backend cpu" in message
    with pytest.raises(CmpchatError) as planned:
        CudaBackend.memory_plans(model_file, ModelConfig.from_model_file(model_file))
    assert one_line(planned) == message


def test_open_model_on_cuda_refuses_it_too(float_path, no_gpu_calls):
    with pytest.raises(CmpchatError, match="--backend cpu"):
        open_model(float_path, backend="cuda")


def test_q8_0_and_q4_k_m_files_pass(tiny_model_path, tmp_path):
    q4_k_m = tmp_path / "tiny-q4_k_m.gguf"
    build_model(q4_k_m, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix="Q4_K_M")
    for path in (tiny_model_path, q4_k_m):
        model_file = ModelFile(path)
        check_gpu_types(model_file, ModelConfig.from_model_file(model_file))
