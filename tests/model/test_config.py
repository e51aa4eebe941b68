"""ModelConfig from `qwen35` metadata: sizes, layer kinds, MTP blocks and architecture errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from cmpchat.errors import CmpchatError
from cmpchat.model.builder import MODEL_SHAPES, tensor_specs
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile
from tests.conftest import TINY_SHAPE


def test_tiny_model_config(tiny_model_path):
    config = ModelConfig.from_model_file(ModelFile(tiny_model_path))
    assert config.hidden_size == 64 and config.ffn_size == 96
    assert config.vocab_size == TINY_SHAPE.vocab_size
    # Interval 2: every second layer is full attention.
    assert config.layer_kinds == (LayerKind.RECURRENT, LayerKind.ATTENTION) * 2
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 32)
    assert (config.num_k_heads, config.num_v_heads, config.k_head_dim, config.v_head_dim) == (2, 4, 32, 32)
    assert config.conv_dim == 2 * 2 * 32 + 4 * 32
    assert config.rope_sections == (3, 3, 2, 0)
    assert not config.tied_embeddings
    assert config.num_mtp_layers == 0


def metadata_file(tmp_path: Path, arch: str, extra: dict | None = None) -> Path:
    """A header-only file with the tiny model's keys (plus `extra`) and a token embedding."""
    import numpy as np

    writer = gguf.GGUFWriter(tmp_path / f"{arch}.gguf", arch)
    s = TINY_SHAPE
    writer.add_block_count(s.num_layers + (extra or {}).get("mtp", 0))
    writer.add_context_length(s.context_length)
    writer.add_embedding_length(s.hidden_size)
    writer.add_feed_forward_length(s.ffn_size)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_rope_dimension_count(s.rope_dims)
    writer.add_ssm_conv_kernel(4)
    writer.add_ssm_state_size(32)
    writer.add_ssm_group_count(2)
    writer.add_ssm_time_step_rank(4)
    writer.add_ssm_inner_size(128)
    if extra and "mtp" in extra:
        writer.add_nextn_predict_layers(extra["mtp"])
    if extra and "recurrent" in extra:
        writer.add_array(f"{arch}.attention.recurrent_layers", extra["recurrent"])
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / f"{arch}.gguf"


def test_recurrent_layers_key_decides_and_mtp_block_is_excluded(tmp_path):
    path = metadata_file(tmp_path, "qwen35", {"mtp": 1, "recurrent": [True, False, False, True, False]})
    config = ModelConfig.from_model_file(ModelFile(path))
    assert config.num_layers == 4
    assert config.num_mtp_layers == 1
    assert config.layer_kinds == (LayerKind.RECURRENT, LayerKind.ATTENTION, LayerKind.ATTENTION, LayerKind.RECURRENT)
    assert config.tied_embeddings


def test_default_interval_is_four(tmp_path):
    config = ModelConfig.from_model_file(ModelFile(metadata_file(tmp_path, "qwen35")))
    assert config.layer_kinds == (LayerKind.RECURRENT,) * 3 + (LayerKind.ATTENTION,)


@pytest.mark.parametrize(
    ("arch", "fragment"),
    [("qwen35moe", "MoE"), ("llama", "architecture 'llama'"), ("clip", "vision projector")],
)
def test_other_architectures_are_refused_by_name(tmp_path, arch, fragment):
    with pytest.raises(CmpchatError, match=fragment) as caught:
        ModelConfig.from_model_file(ModelFile(metadata_file(tmp_path, arch)))
    assert "\n" not in str(caught.value)


def test_released_shapes_match_the_published_bytes_per_token():
    """docs/model.md: Q8_0 bytes read per decoded token (without the embedding) 9B ~ 8.4 GB, 27B ~ 27.2 GB."""
    for name, expected in [("9B", 8.4e9), ("27B", 27.2e9)]:
        specs = tensor_specs(MODEL_SHAPES[name])
        matrix_bytes = sum(
            spec.shape[0] * spec.shape[1] // 32 * 34
            for spec in specs
            if spec.role == "matrix" and spec.name != "token_embd.weight"
        )
        assert abs(matrix_bytes - expected) / expected < 0.03, (name, matrix_bytes)
