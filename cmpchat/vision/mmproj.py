"""The vision projector file (llama.cpp's mmproj GGUF, `clip` architecture, `qwen3vl_merger` projector).

`open_projector` checks the file is a Qwen3.5 image encoder whose output width is the text model's, and gives
its sizes (`VisionConfig`) and its tensors as float32 arrays in numpy order (`ProjectorWeights`). Every way the
file can be unusable is one `CmpchatError` line naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_file import ModelFile
from cmpchat.vision.preprocess import PatchSettings

ARCHITECTURE = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"
# llama.cpp splits the Conv3d over the temporal pair into two Conv2d kernels; Qwen3.5's pair is 2 frames.
TEMPORAL_PATCH = 2
# Not stored in the file: Qwen3.5's vision RoPE base (transformers' Qwen3_5VisionConfig default).
ROPE_THETA = 10_000.0


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """Sizes of the vision encoder, read from `clip.vision.*` metadata."""

    name: str
    width: int
    depth: int
    num_heads: int
    ffn_size: int
    patch_size: int
    merge_size: int
    position_grid: int
    """Side of the learned square position-embedding grid (48 in the released models)."""
    projection_dim: int
    """Width of the merged tokens: the text model's hidden size."""
    layer_norm_eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    temporal_patch: int = TEMPORAL_PATCH
    rope_theta: float = ROPE_THETA

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_settings(self) -> PatchSettings:
        return PatchSettings(self.patch_size, self.merge_size, self.temporal_patch, self.image_mean, self.image_std)

    @property
    def merged_width(self) -> int:
        """Width of a merged token before the merger MLP: 2x2 patches side by side."""
        return self.width * self.merge_size**2


@dataclass(frozen=True, slots=True)
class VisionBlockWeights:
    """One ViT block; matrices are [out, in]."""

    ln1_weight: np.ndarray
    ln1_bias: np.ndarray
    qkv_weight: np.ndarray
    qkv_bias: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray
    ln2_weight: np.ndarray
    ln2_bias: np.ndarray
    up_weight: np.ndarray
    up_bias: np.ndarray
    down_weight: np.ndarray
    down_bias: np.ndarray


@dataclass(frozen=True, slots=True)
class ProjectorWeights:
    """Every tensor of the encoder as float32, numpy order."""

    patch_weight: np.ndarray
    """[width, 3 channels, temporal pair, patch, patch]: the Conv3d kernel, the two frames stacked back."""
    patch_bias: np.ndarray
    position_embedding: np.ndarray
    """[position_grid**2, width], row-major over the grid."""
    blocks: tuple[VisionBlockWeights, ...]
    post_ln_weight: np.ndarray
    post_ln_bias: np.ndarray
    merger_fc1_weight: np.ndarray
    merger_fc1_bias: np.ndarray
    merger_fc2_weight: np.ndarray
    merger_fc2_bias: np.ndarray


@dataclass(frozen=True, slots=True)
class Projector:
    config: VisionConfig
    weights: ProjectorWeights


def open_projector(path: str | os.PathLike[str], text_width: int | None = None) -> Projector:
    """Read an mmproj file; with `text_width`, refuse one whose output width is not the text model's."""
    model_file = ModelFile(path)
    config = read_vision_config(model_file)
    file_name = model_file.path.name
    if text_width is not None and config.projection_dim != text_width:
        raise CmpchatError(
            f"{file_name} projects images to width {config.projection_dim}, but the model's hidden size is "
            f"{text_width}; use the mmproj file made for this model"
        )
    return Projector(config, _read_weights(model_file, config))


def read_vision_config(model_file: ModelFile) -> VisionConfig:
    file_name = model_file.path.name
    arch = model_file.architecture
    if arch != ARCHITECTURE:
        raise CmpchatError(
            f"{file_name} is architecture '{arch or 'none'}', not a vision projector (mmproj, architecture 'clip')"
        )
    projector = model_file.get("clip.projector_type") or model_file.get("clip.vision.projector_type")
    if projector != PROJECTOR_TYPE:
        raise CmpchatError(
            f"{file_name} is a '{projector}' projector; cmpchat reads only Qwen3.5's ('{PROJECTOR_TYPE}')"
        )
    if not model_file.get("clip.has_vision_encoder", False):
        raise CmpchatError(f"{file_name} has no vision encoder")
    if any(model_file.get("clip.vision.is_deepstack_layers", [])):
        raise CmpchatError(f"{file_name} has deepstack layers (a Qwen3-VL projector); Qwen3.5's projector has none")

    def number(key: str) -> int:
        return int(model_file.require(f"clip.vision.{key}"))

    width = number("embedding_length")
    num_heads = number("attention.head_count")
    patch_size = number("patch_size")
    positions = model_file.tensor_info("v.position_embd.weight").shape
    grid = round(positions[0] ** 0.5)
    config = VisionConfig(
        name=str(model_file.get("general.name") or model_file.path.stem),
        width=width,
        depth=number("block_count"),
        num_heads=num_heads,
        ffn_size=number("feed_forward_length"),
        patch_size=patch_size,
        merge_size=int(model_file.get("clip.vision.spatial_merge_size", 2)),
        position_grid=grid,
        projection_dim=number("projection_dim"),
        layer_norm_eps=float(model_file.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        image_mean=_triple(model_file, "image_mean"),
        image_std=_triple(model_file, "image_std"),
    )
    problems = [
        (width % num_heads == 0 and (width // num_heads) % 4 == 0, "width is not heads x a multiple of 4"),
        (grid * grid == positions[0] and positions[1] == width, "position embedding is not a square grid"),
    ]
    for ok, problem in problems:
        if not ok:
            raise CmpchatError(f"{file_name}: {problem}; the file's metadata is inconsistent")
    return config


def _triple(model_file: ModelFile, key: str) -> tuple[float, float, float]:
    values = model_file.get(f"clip.vision.{key}", [0.5, 0.5, 0.5])
    if len(values) != 3:
        raise CmpchatError(f"{model_file.path.name}: clip.vision.{key} has {len(values)} values, not 3 (RGB)")
    return (float(values[0]), float(values[1]), float(values[2]))


def _read_weights(model_file: ModelFile, config: VisionConfig) -> ProjectorWeights:
    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        found = model_file.tensor_info(name).shape
        if found != shape:
            raise CmpchatError(
                f"{model_file.path.name}: tensor '{name}' has shape {list(found)}, expected {list(shape)} "
                f"from the file's metadata; the file is damaged or not a Qwen3.5 projector"
            )
        return np.asarray(model_file.dequantize(name), dtype=np.float32)

    d, f, p = config.width, config.ffn_size, config.patch_size
    frames = [tensor(name, (d, 3, p, p)) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
    blocks = tuple(
        VisionBlockWeights(
            ln1_weight=tensor(f"v.blk.{i}.ln1.weight", (d,)),
            ln1_bias=tensor(f"v.blk.{i}.ln1.bias", (d,)),
            qkv_weight=tensor(f"v.blk.{i}.attn_qkv.weight", (3 * d, d)),
            qkv_bias=tensor(f"v.blk.{i}.attn_qkv.bias", (3 * d,)),
            out_weight=tensor(f"v.blk.{i}.attn_out.weight", (d, d)),
            out_bias=tensor(f"v.blk.{i}.attn_out.bias", (d,)),
            ln2_weight=tensor(f"v.blk.{i}.ln2.weight", (d,)),
            ln2_bias=tensor(f"v.blk.{i}.ln2.bias", (d,)),
            up_weight=tensor(f"v.blk.{i}.ffn_up.weight", (f, d)),
            up_bias=tensor(f"v.blk.{i}.ffn_up.bias", (f,)),
            down_weight=tensor(f"v.blk.{i}.ffn_down.weight", (d, f)),
            down_bias=tensor(f"v.blk.{i}.ffn_down.bias", (d,)),
        )
        for i in range(config.depth)
    )
    m = config.merged_width
    return ProjectorWeights(
        patch_weight=np.stack(frames, axis=2),
        patch_bias=tensor("v.patch_embd.bias", (d,)),
        position_embedding=tensor("v.position_embd.weight", (config.position_grid**2, d)),
        blocks=blocks,
        post_ln_weight=tensor("v.post_ln.weight", (d,)),
        post_ln_bias=tensor("v.post_ln.bias", (d,)),
        merger_fc1_weight=tensor("mm.0.weight", (m, m)),
        merger_fc1_bias=tensor("mm.0.bias", (m,)),
        merger_fc2_weight=tensor("mm.2.weight", (config.projection_dim, m)),
        merger_fc2_bias=tensor("mm.2.bias", (config.projection_dim,)),
    )
