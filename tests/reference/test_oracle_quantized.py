"""The oracle models as llama.cpp's llama-quantize writes them (tests/fixtures/oracle/quantized.json, made by
quantize_oracle.py): files mixing 4/5/6/8-bit block types with F32, read and run by the reference backend.

- The reader's values of every tensor are the `gguf` package's dequantisation of the same bytes, bit for bit,
  and each tensor is a rounding of the F32 oracle file's (relative RMS error within 3 / 2^bits; the files
  reach under half of that).
- The reference on a quantised file equals the reference on an F32 copy of it written from the `gguf` package's
  dequantisation: the same values in the same fp32 arithmetic, so its paths for block types (rows dequantised
  in the matmuls, the embedding lookup, the LM head) must add nothing (bound 1e-4; they agree to the bit). The
  reference on F32 files is held to transformers by test_oracle.py.
- How far a file's logits are from the F32 oracle's is printed, not bounded: these random nets amplify the
  rounding (Q8_0 alone moves them by up to ~2.3; README.md).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.gpu.weights import check_gpu_types
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle"
MANIFEST = json.loads((ORACLE / "manifest.json").read_text())
QUANTIZED = json.loads((ORACLE / "quantized.json").read_text())["files"]
FILES = list(QUANTIZED)
PROMPTS = {name: prompt["ids"] for name, prompt in MANIFEST["prompts"].items()}
BITS = {T.Q4_0: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8}
SAME_VALUES_TOLERANCE = 1e-4


@cache
def oracle_logits(model: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE / f"{model}.npz") as data:
        return {prompt: data[f"logits_{prompt}"] for prompt in PROMPTS}


def score(backend: ReferenceBackend, ids: list[int]) -> np.ndarray:
    sequence = backend.new_sequence()
    logits = backend.score(sequence, ids)
    backend.release(sequence)
    return logits


def f32_copy(source: Path, out: Path) -> Path:
    """`source` with every tensor replaced by the gguf package's F32 dequantisation of it, metadata unchanged."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(out, arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("name", FILES)
def test_the_files_are_those_of_the_manifest(name):
    entry = QUANTIZED[name]
    path = ORACLE / name
    assert path.stat().st_size == entry["bytes"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    assert entry["source_sha256"] == MANIFEST["models"][entry["model"]]["files"]["f32"]["sha256"]
    model_file = ModelFile(path)
    assert {tensor: info.type_name for tensor, info in model_file.tensors.items()} == entry["tensor_types"]
    assert {t.name: n for t, n, _ in model_file.type_mix()} == entry["type_counts"]


def test_the_files_mix_every_block_type_llama_quantize_gives_them_and_the_cuda_backend_runs_them():
    types = {tensor_type for entry in QUANTIZED.values() for tensor_type in entry["type_counts"]}
    assert types == {"F32", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    for name in FILES:
        model_file = ModelFile(ORACLE / name)
        check_gpu_types(model_file, ModelConfig.from_model_file(model_file))


@pytest.mark.parametrize("name", FILES)
def test_every_tensor_reads_as_the_gguf_package_dequantises_it(name):
    model_file = ModelFile(ORACLE / name)
    for tensor in gguf.GGUFReader(str(ORACLE / name)).tensors:
        got = model_file.dequantize(tensor.name)
        expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(got.shape)
        assert got.dtype == expected.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), tensor.name


@pytest.mark.parametrize("name", FILES)
def test_every_tensor_is_a_rounding_of_the_f32_oracles(name):
    model_file = ModelFile(ORACLE / name)
    f32 = ModelFile(ORACLE / f"{QUANTIZED[name]['model']}.f32.gguf")
    assert model_file.tensors.keys() == f32.tensors.keys()
    for tensor, info in model_file.tensors.items():
        got, exact = model_file.dequantize(tensor), f32.dequantize(tensor)
        if info.type == T.F32:
            assert np.array_equal(got, exact), tensor
        else:
            relative_rms = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2))
            assert relative_rms <= 3 / 2 ** BITS[info.type], (tensor, info.type_name, relative_rms)


@pytest.mark.parametrize("name", FILES)
def test_the_reference_on_a_file_equals_it_on_an_f32_copy(name, tmp_path):
    quantized = ReferenceBackend(ModelFile(ORACLE / name))
    copy = ReferenceBackend(ModelFile(f32_copy(ORACLE / name, tmp_path / name)))
    assert all(copy.model_file.tensor_info(tensor).type == T.F32 for tensor in copy.model_file.tensors)
    from_oracle = {}
    for prompt, ids in PROMPTS.items():
        got = score(quantized, ids)
        assert got.shape == (len(ids), quantized.config.vocab_size) and np.isfinite(got).all()
        assert np.abs(got - score(copy, ids)).max() <= SAME_VALUES_TOLERANCE
        from_oracle[prompt] = np.abs(got - oracle_logits(QUANTIZED[name]["model"])[prompt]).max()
    print(f"{name}: max |logit - F32 oracle logit| " + ", ".join(f"{p} {d:.2f}" for p, d in from_oracle.items()))
