"""The model builder's llama.cpp type mixes (Q4_K_M, Q5_K_M): the type of each matrix, and files of valid
random blocks with the intended spread."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.model.builder import MODEL_SHAPES, build_model, matrix_types, pack_k_scales, random_blocks
from cmpchat.model.dequant import BLOCK_FORMATS, _k_scales, dequantize_rows
from cmpchat.model.gguf_file import ModelFile
from tests.conftest import WIDE_SHAPE, add_byte_vocabulary

MORE_BITS_24 = [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
"""llama-quantize's use_more_bits(i, 24): the first and last eighth, and every third layer from the fifth."""


def test_q4_k_m_on_the_0_8b_shapes():
    types = matrix_types(MODEL_SHAPES["0.8B"], "Q4_K_M")
    assert types["token_embd.weight"] == T.Q6_K  # tied: the embedding is also the output head
    for i in range(24):
        value = "attn_v" if (i + 1) % 4 == 0 else "attn_qkv"  # attention every fourth layer, else GDN
        high = T.Q6_K if i in MORE_BITS_24 else T.Q4_K
        assert types[f"blk.{i}.{value}.weight"] == high
        assert types[f"blk.{i}.ffn_down.weight"] == high
        assert types[f"blk.{i}.ffn_up.weight"] == types[f"blk.{i}.ffn_gate.weight"] == T.Q4_K
    assert Counter(types.values()) == {T.Q4_K: 162, T.Q6_K: 1 + 2 * len(MORE_BITS_24)}


def test_q5_k_m_on_the_9b_shapes_keeps_an_untied_embedding_at_the_base_type():
    types = matrix_types(MODEL_SHAPES["9B"], "Q5_K_M")
    assert types["token_embd.weight"] == T.Q5_K and types["output.weight"] == T.Q6_K
    assert set(types.values()) == {T.Q5_K, T.Q6_K}


def test_narrow_matrices_fall_back_to_32_value_types():
    types = matrix_types(WIDE_SHAPE, "Q4_K_M")
    assert types["blk.1.attn_output.weight"] == T.Q5_0  # 64 inputs
    assert types["blk.0.ssm_out.weight"] == T.Q5_0  # 128 inputs
    assert types["blk.3.attn_v.weight"] == types["output.weight"] == T.Q6_K  # 256 inputs: no fallback


def test_k_scales_pack_and_unpack():
    rng = np.random.default_rng(0)
    scales, mins = rng.integers(0, 64, (100, 8)), rng.integers(0, 64, (100, 8))
    got_scales, got_mins = _k_scales(pack_k_scales(scales, mins))
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_mins, mins)


@pytest.mark.parametrize("tensor_type", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_random_blocks_have_the_intended_spread(tensor_type):
    values = dequantize_rows(random_blocks(np.random.default_rng(1), tensor_type, 64, 1024), tensor_type, 1024)
    assert np.isfinite(values).all()
    assert 0.8 < values.std() * np.sqrt(1024) < 1.25
    assert abs(values.mean()) * np.sqrt(1024) < 0.15


def test_a_q4_k_m_file_reads_back_with_its_types(tmp_path):
    path = tmp_path / "q4_k_m.gguf"
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix="Q4_K_M")
    model_file = ModelFile(path)
    assert model_file.get("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for name, tensor_type in matrix_types(WIDE_SHAPE, "Q4_K_M").items():
        assert model_file.tensor_info(name).type == tensor_type
    assert model_file.tensor_info("blk.0.ssm_conv1d.weight").type == T.F32
    assert np.isfinite(model_file.dequantize("blk.0.ffn_down.weight")).all()


def test_pooled_files_use_every_type_of_the_mix(tmp_path):
    path = tmp_path / "pooled.gguf"
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix="Q5_K_M", pooled=True)
    model_file = ModelFile(path)
    assert {t for t, _, _ in model_file.type_mix()} == {T.Q5_K, T.Q6_K, T.Q5_1, T.F32}
    assert np.isfinite(model_file.dequantize("token_embd.weight")).all()


def test_a_mix_must_fit_the_shape(tmp_path):
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        build_model(tmp_path / "x.gguf", WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None,
                    mix={"blk.1.attn_output.weight": T.Q4_K})  # fmt: skip
    with pytest.raises(ValueError, match="unknown mix"):
        matrix_types(WIDE_SHAPE, "Q3_K_M")
