"""The mmproj reader on llama.cpp's conversion of a small random Qwen3.5 vision tower, and its refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.mmproj import open_projector
from tests.vision.vision_fixtures import MMPROJ_F16, MMPROJ_F32, ORACLE, manifest


def test_config_is_the_converted_models():
    config = open_projector(MMPROJ_F32).config
    vision = manifest()["vision_config"]
    assert (config.width, config.depth, config.num_heads, config.ffn_size) == (
        vision["hidden_size"],
        vision["depth"],
        vision["num_heads"],
        vision["intermediate_size"],
    )
    assert (config.patch_size, config.merge_size, config.temporal_patch) == (16, 2, 2)
    assert config.position_grid**2 == vision["num_position_embeddings"]
    assert config.projection_dim == vision["out_hidden_size"]
    assert config.image_mean == config.image_std == (0.5, 0.5, 0.5)
    assert config.layer_norm_eps == pytest.approx(1e-6)


def test_weights_have_the_encoder_shapes_and_f16_rounds_f32():
    full = open_projector(MMPROJ_F32).weights
    half = open_projector(MMPROJ_F16).weights
    assert full.patch_weight.shape == (64, 3, 2, 16, 16)
    assert not np.array_equal(full.patch_weight[:, :, 0], full.patch_weight[:, :, 1])
    assert full.position_embedding.shape == (16, 64)
    assert len(full.blocks) == 2 and full.blocks[1].qkv_weight.shape == (192, 64)
    assert full.merger_fc1_weight.shape == (256, 256) and full.merger_fc2_weight.shape == (32, 256)
    # The F16 file rounds the matrices only; 1-D tensors stay F32.
    np.testing.assert_allclose(half.patch_weight, full.patch_weight, rtol=1e-3, atol=1e-4)
    assert not np.array_equal(half.patch_weight, full.patch_weight)
    np.testing.assert_array_equal(half.blocks[0].ln1_weight, full.blocks[0].ln1_weight)


def test_pairs_with_the_text_model_of_its_width():
    text = ModelConfig.from_model_file(ModelFile(ORACLE / "tiny_tied.f32.gguf"))
    assert open_projector(MMPROJ_F32, text_width=text.hidden_size).config.projection_dim == 32
    wider = ModelConfig.from_model_file(ModelFile(ORACLE / "tiny_untied.f32.gguf"))
    with pytest.raises(CmpchatError, match=r"projects images to width 32, but the model's hidden size is 64"):
        open_projector(MMPROJ_F32, text_width=wider.hidden_size)


def test_refuses_a_language_model():
    with pytest.raises(CmpchatError, match=r"tiny_tied.f32.gguf is architecture 'qwen35', not a vision projector"):
        open_projector(ORACLE / "tiny_tied.f32.gguf")


def rewritten(tmp_path: Path, changes: dict[str, Any], drop_tensor: str | None = None) -> Path:
    """A copy of the F32 mmproj with some metadata values replaced (or a tensor left out)."""
    reader = gguf.GGUFReader(str(MMPROJ_F32))
    out = tmp_path / "changed-mmproj.gguf"
    writer = gguf.GGUFWriter(out, arch=changes.get("general.architecture", "clip"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, field.contents())
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name != drop_tensor:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"clip.projector_type": "mlp"}, r"is a 'mlp' projector; cmpchat reads only Qwen3.5's \('qwen3vl_merger'\)"),
        ({"clip.vision.is_deepstack_layers": [True, False]}, r"has deepstack layers \(a Qwen3-VL projector\)"),
        ({"clip.has_vision_encoder": False}, r"has no vision encoder"),
        (
            {"clip.vision.feed_forward_length": 128},
            r"tensor 'v.blk.0.ffn_up.weight' has shape \[96, 64\], expected \[128, 64\]",
        ),
        ({"general.architecture": "llama"}, r"is architecture 'llama', not a vision projector"),
    ],
)
def test_refuses_a_file_that_is_not_qwen35s_projector(tmp_path, changes, message):
    with pytest.raises(CmpchatError, match=message):
        open_projector(rewritten(tmp_path, changes))


def test_names_a_missing_tensor(tmp_path):
    assert open_projector(rewritten(tmp_path, {})).config.depth == 2  # the copy itself is readable
    with pytest.raises(CmpchatError, match=r"tensor 'mm.2.bias' is missing"):
        open_projector(rewritten(tmp_path, {}, drop_tensor="mm.2.bias"))
