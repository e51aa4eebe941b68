"""The GGUF reader: metadata, exact tensor values for every supported type, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import q8_0_quantize


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]],
    fields: dict[str, tuple[object, gguf.GGUFValueType]] | None = None,
    arch: str = "qwen35",
) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (fields or {}).items():
        writer.add_key_value(key, value[0], value[1])
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def typed_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal((3, 64)).astype(np.float32) for name in ("f32", "f16", "bf16", "q8_0")}
    bf16_bits = (values["bf16"].view(np.uint32) >> 16).astype(np.uint16)
    values["f16"] = values["f16"].astype(np.float16).astype(np.float32)
    values["bf16"] = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    q8 = q8_0_quantize(values["q8_0"])
    values["q8_0"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    path = write_gguf(
        tmp_path / "typed.gguf",
        {
            "f32": (values["f32"], None),
            "f16": (values["f16"].astype(np.float16), None),
            "bf16": (bf16_bits, gguf.GGMLQuantizationType.BF16),
            "q8_0": (q8, gguf.GGMLQuantizationType.Q8_0),
        },
        {
            "general.name": ("typed", gguf.GGUFValueType.STRING),
            "test.ints": ([1, 2, 3], gguf.GGUFValueType.ARRAY),
            "test.words": (["a", "ü", ""], gguf.GGUFValueType.ARRAY),
            "test.flag": (True, gguf.GGUFValueType.BOOL),
            "test.float": (0.5, gguf.GGUFValueType.FLOAT32),
        },
    )
    return path, values


def test_metadata_values_are_plain_python(typed_file):
    path, _ = typed_file
    metadata = ModelFile(path).metadata
    assert metadata["general.architecture"] == "qwen35"
    assert metadata["general.name"] == "typed"
    assert metadata["test.ints"] == [1, 2, 3]
    assert metadata["test.words"] == ["a", "ü", ""]
    assert metadata["test.flag"] is True
    assert metadata["test.float"] == 0.5


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0"])
def test_every_supported_type_dequantizes_exactly(typed_file, name):
    path, values = typed_file
    model_file = ModelFile(path)
    assert model_file.tensor_info(name).shape == (3, 64)
    np.testing.assert_array_equal(model_file.dequantize(name), values[name])
    np.testing.assert_array_equal(model_file.dequantize(name, rows=np.array([2, 0])), values[name][[2, 0]])


def test_q8_0_parts_are_views_of_the_blocks(typed_file):
    path, values = typed_file
    scales, quants = ModelFile(path).q8_0_parts("q8_0")
    assert scales.shape == (3, 2) and scales.dtype == np.float16
    assert quants.shape == (3, 2, 32) and quants.dtype == np.int8
    rebuilt = (quants.astype(np.float32) * scales.astype(np.float32)[..., None]).reshape(3, 64)
    np.testing.assert_array_equal(rebuilt, values["q8_0"])


def test_reads_the_tiny_model(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    assert model_file.architecture == "qwen35"
    assert model_file.tensor_info("blk.0.attn_qkv.weight").type_name == "Q8_0"
    assert model_file.tensor_info("blk.0.ssm_a").type_name == "F32"


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(CmpchatError) as caught:
        ModelFile(path)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_file_and_folder(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path, "is a folder")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x00" * 100)
    expect_error(path, "not a GGUF file")


def test_truncated_header_and_data(tiny_model_path, tmp_path):
    data = tiny_model_path.read_bytes()
    cut_header = tmp_path / "cut-header.gguf"
    cut_header.write_bytes(data[:200])
    expect_error(cut_header, "truncated")
    cut_data = tmp_path / "cut-data.gguf"
    cut_data.write_bytes(data[: len(data) - 1000])
    expect_error(cut_data, "truncated", "runs past the end")


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", "Q2_K", "Q3_K"])
def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, name):
    tensor_type = gguf.GGMLQuantizationType[name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((2, 256 // block_values * block_bytes), dtype=np.uint8)
    path = write_gguf(tmp_path / "other.gguf", {"blk.0.ffn_up.weight": (raw, tensor_type)})
    message = expect_error(path, "'blk.0.ffn_up.weight'", f"type {name},", "Q4_K", "Q8_0")
    assert message.count(name) == 1  # named once as the tensor's type, not among the types cmpchat reads


def test_a_block_type_row_must_be_whole_blocks(tmp_path):
    raw = np.zeros((2, 144), dtype=np.uint8)  # 2 rows of one Q4_K block (256 values)...
    path = write_gguf(tmp_path / "odd.gguf", {"w": (raw, gguf.GGMLQuantizationType.Q4_K)})
    data = bytearray(path.read_bytes())
    at = data.index(b"w\x02\x00\x00\x00") + 5  # past the name and the dimension count: ne0
    assert int.from_bytes(data[at : at + 8], "little") == 256
    data[at : at + 8] = (128).to_bytes(8, "little")  # ...declared 128 wide
    path.write_bytes(bytes(data))
    expect_error(path, "damaged", "'w'", "128 values", "256-value blocks")


def test_unknown_version(tiny_model_path, tmp_path):
    data = bytearray(tiny_model_path.read_bytes())
    data[4:8] = (9).to_bytes(4, "little")
    path = tmp_path / "v9.gguf"
    path.write_bytes(bytes(data))
    expect_error(path, "version 9")


def test_missing_tensor_is_named(tiny_model_path):
    with pytest.raises(CmpchatError, match="'blk.0.nothing.weight' is missing"):
        ModelFile(tiny_model_path).tensor_info("blk.0.nothing.weight")
