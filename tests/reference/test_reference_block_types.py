"""The reference backend on files that mix tensor types (every block type the reader reads): the same logits as
the same weights stored as F32, with the weights unpacked to fp32 at load and kept packed in the file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.reference import model as reference_model
from cmpchat.backends.reference.layers import Linear
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.builder import ModelShape, build_model, tensor_specs
from cmpchat.model.dequant import BLOCK_FORMATS
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import INT8_ACTIVATION_TYPES, int8_rounded
from tests.conftest import WIDE_SHAPE, add_byte_vocabulary

TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 259, 24)]


def every_type_mix(shape: ModelShape) -> dict[str, T]:
    """A type per matrix: the least used so far of the block types its width allows."""
    used = dict.fromkeys(BLOCK_FORMATS, 0)
    mix = {}
    for spec in tensor_specs(shape):
        if spec.role == "matrix":
            fits = [t for t in used if spec.shape[1] % BLOCK_FORMATS[t].values == 0]
            mix[spec.name] = chosen = min(fits, key=lambda t: used[t])
            used[chosen] += 1
    return mix


def build(path: Path, mix: str | dict[str, T], *, as_f32: bool = False) -> Path:
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, seed=3, mix=mix,
                as_f32=as_f32)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The mixed-type file and its F32 twin (the same seed draws the same blocks)."""
    folder = tmp_path_factory.mktemp("block-types")
    mix = every_type_mix(WIDE_SHAPE)
    assert set(mix.values()) == set(BLOCK_FORMATS)
    return build(folder / "mixed.gguf", mix), build(folder / "mixed-f32.gguf", mix, as_f32=True)


@pytest.fixture(scope="module")
def twin_scores(files: tuple[Path, Path]) -> np.ndarray:
    return scores(files[1])


def scores(path: Path, **options: object) -> np.ndarray:
    backend = ReferenceBackend(ModelFile(path), **options)  # type: ignore[arg-type]
    return backend.score(backend.new_sequence(), TOKENS)


@pytest.fixture
def packed_weights(monkeypatch: pytest.MonkeyPatch, files: tuple[Path, Path]) -> Iterator[None]:
    """RAM as if it held the packed weights but not their fp32 values, so the backend keeps them packed."""
    model_file = ModelFile(files[0])
    packed = sum(info.n_bytes for info in model_file.tensors.values() if len(info.shape) == 2)
    monkeypatch.setattr(reference_model, "_available_memory", lambda: 2 * packed)
    monkeypatch.setattr(Linear, "ROW_BLOCK_VALUES", 256 * 48)  # several row blocks a matrix
    yield


def test_the_mixed_file_holds_every_block_type(files):
    mixed, twin = ModelFile(files[0]), ModelFile(files[1])
    assert {t for t, _, _ in mixed.type_mix()} == set(BLOCK_FORMATS) | {T.F32}
    assert {t for t, _, _ in twin.type_mix()} == {T.F32}
    for name, info in mixed.tensors.items():
        np.testing.assert_array_equal(mixed.dequantize(name), twin.dequantize(name))
        assert twin.tensor_info(name).shape == info.shape


def test_logits_equal_the_f32_twins(files, twin_scores):
    """Unpacked, every matrix holds exactly the values the twin stores, so the same BLAS calls give the same bits."""
    mixed, twin = scores(files[0]), twin_scores
    assert np.isfinite(mixed).all() and np.abs(mixed).max() > 0.1
    np.testing.assert_array_equal(mixed, twin)


def test_packed_weights_give_the_same_logits(files, twin_scores, packed_weights):
    backend = ReferenceBackend(ModelFile(files[0]))
    assert not backend.weights_unpacked
    assert backend.describe()[0].startswith("weights: kept packed and dequantised in every matmul (slow)")
    assert all(linear.packed and linear.host_bytes == 0 for linear in backend.linears())
    packed = backend.score(backend.new_sequence(), TOKENS)
    twin = twin_scores
    np.testing.assert_allclose(packed, twin, rtol=0, atol=1e-4 * np.abs(twin).max())  # as chunked prefill


def test_weights_are_unpacked_when_they_fit(files):
    backend = ReferenceBackend(ModelFile(files[0]))
    assert backend.weights_unpacked and backend.describe() == []
    assert all(not linear.packed for linear in backend.linears())


def test_mirror_gpu_runs_and_its_int8_path_is_the_same_packed_or_not(files, monkeypatch):
    """GPU mirroring takes Q8_0's int8 path, multiplies the 4/5/6-bit types' exact weights by the activations
    rounded to int8 as the GPU quantises them, and float weights by the activations as they are. A packed Q8_0
    Linear gives the same bits as an unpacked one."""
    model_file = ModelFile(files[0])
    mirrored = scores(files[0], mirror_gpu=True)
    assert np.isfinite(mirrored).all()
    # Every quantised matmul's input rounded to int8: on this random model the logits move by up to 7.4% of the
    # largest (measured on 2026-12-04).
    np.testing.assert_allclose(mirrored, scores(files[0]), rtol=0, atol=0.15 * np.abs(mirrored).max())
    monkeypatch.setattr(Linear, "ROW_BLOCK_VALUES", 256 * 48)
    x = np.random.default_rng(0).standard_normal((3, WIDE_SHAPE.hidden_size)).astype(np.float32)
    by_type = {info.type: name for name, info in model_file.tensors.items() if name.endswith("ffn_gate.weight")}
    by_type.update({info.type: name for name, info in model_file.tensors.items() if "attn_q.weight" in name})
    by_type.update({info.type: name for name, info in model_file.tensors.items() if "attn_qkv.weight" in name})
    for tensor_type, name in by_type.items():
        packed = Linear(model_file, name, mirror_gpu=True)
        unpacked = Linear(model_file, name, mirror_gpu=True)
        unpacked.unpack()
        if tensor_type == T.Q8_0:
            np.testing.assert_array_equal(packed(x), unpacked(x))
        else:
            seen = int8_rounded(x) if tensor_type in INT8_ACTIVATION_TYPES else x
            np.testing.assert_allclose(packed(x), unpacked(x), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(unpacked(x), seen @ model_file.dequantize(name).T, rtol=1e-5, atol=1e-6)
    assert T.Q8_0 in by_type and len(by_type) > 2 and INT8_ACTIVATION_TYPES & set(by_type) - {T.Q8_0}
    assert np.abs(int8_rounded(x) - x).max() > 1e-3  # the rounding is visible at this tolerance


def test_packed_weights_that_do_not_fit_are_refused_in_one_line(files, monkeypatch):
    monkeypatch.setattr(reference_model, "_available_memory", lambda: 1000)
    with pytest.raises(reference_model.CmpchatError) as caught:
        ReferenceBackend(ModelFile(files[0]))
    message = str(caught.value)
    assert "\n" not in message and "GiB of RAM" in message and "mixed.gguf" in message


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_llama_cpp_mixes_run(tmp_path, mix):
    path = build(tmp_path / f"{mix}.gguf", mix)
    logits = scores(path)
    assert np.isfinite(logits).all() and np.abs(logits).max() > 0.1
