"""Writes random-weight Qwen3.5 GGUF files: the demo model and files with the shapes of the released sizes.

One builder serves both: the demo model that every front end runs on a fresh machine, and the benchmark
files that llama.cpp can load too. Tensors are generated and written one at a time, so a 27B-shaped file
never needs more than one tensor in memory. Weights are random: such a model's output is random text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from cmpchat.model.quant import Q8_0_BLOCK, Q8_0_BLOCK_BYTES

ARCHITECTURE = "qwen35"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that define a Qwen3.5 dense hybrid model (docs/model.md, "Released sizes")."""

    name: str
    hidden_size: int
    num_layers: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    num_k_heads: int
    num_v_heads: int
    tied_embeddings: bool
    head_dim: int = 256
    k_head_dim: int = 128
    v_head_dim: int = 128
    conv_kernel: int = 4
    rope_dims: int = 64
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)
    rope_theta: float = 10_000_000.0
    full_attention_interval: int = 4
    context_length: int = 262_144
    vocab_size: int = 248_320
    rms_eps: float = 1e-6

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0


# The released sizes, and the demo model: real head sizes and vocabulary, tiny width and depth.
MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in [
        ModelShape("demo", 512, 4, 1536, 2, 1, 2, 4, tied_embeddings=True),
        ModelShape("0.8B", 1024, 24, 3584, 8, 2, 16, 16, tied_embeddings=True),
        ModelShape("2B", 2048, 24, 6144, 8, 2, 16, 16, tied_embeddings=True),
        ModelShape("4B", 2560, 32, 9216, 16, 4, 16, 32, tied_embeddings=True),
        ModelShape("9B", 4096, 32, 12288, 16, 4, 16, 32, tied_embeddings=False),
        ModelShape("27B", 5120, 64, 17408, 24, 4, 16, 48, tied_embeddings=False),
    ]
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (outputs, inputs)
    role: str  # "matrix", "norm", "conv", "decay", "dt_bias"


def tensor_specs(shape: ModelShape) -> list[TensorSpec]:
    """Every tensor of the text model, in the order llama.cpp's converter writes them."""
    d = shape.hidden_size
    specs = [TensorSpec("token_embd.weight", (shape.vocab_size, d), "matrix")]
    for i in range(shape.num_layers):
        p = f"blk.{i}."
        specs.append(TensorSpec(p + "attn_norm.weight", (d,), "norm"))
        if shape.is_attention(i):
            specs += [
                TensorSpec(p + "attn_q.weight", (2 * shape.num_heads * shape.head_dim, d), "matrix"),
                TensorSpec(p + "attn_k.weight", (shape.num_kv_heads * shape.head_dim, d), "matrix"),
                TensorSpec(p + "attn_v.weight", (shape.num_kv_heads * shape.head_dim, d), "matrix"),
                TensorSpec(p + "attn_output.weight", (d, shape.num_heads * shape.head_dim), "matrix"),
                TensorSpec(p + "attn_q_norm.weight", (shape.head_dim,), "norm"),
                TensorSpec(p + "attn_k_norm.weight", (shape.head_dim,), "norm"),
            ]
        else:
            value_width = shape.num_v_heads * shape.v_head_dim
            specs += [
                TensorSpec(p + "attn_qkv.weight", (shape.conv_dim, d), "matrix"),
                TensorSpec(p + "attn_gate.weight", (value_width, d), "matrix"),
                TensorSpec(p + "ssm_beta.weight", (shape.num_v_heads, d), "matrix"),
                TensorSpec(p + "ssm_alpha.weight", (shape.num_v_heads, d), "matrix"),
                TensorSpec(p + "ssm_dt.bias", (shape.num_v_heads,), "dt_bias"),
                TensorSpec(p + "ssm_a", (shape.num_v_heads,), "decay"),
                TensorSpec(p + "ssm_conv1d.weight", (shape.conv_dim, shape.conv_kernel), "conv"),
                TensorSpec(p + "ssm_norm.weight", (shape.v_head_dim,), "norm"),
                TensorSpec(p + "ssm_out.weight", (d, value_width), "matrix"),
            ]
        specs += [
            TensorSpec(p + "post_attention_norm.weight", (d,), "norm"),
            TensorSpec(p + "ffn_gate.weight", (shape.ffn_size, d), "matrix"),
            TensorSpec(p + "ffn_up.weight", (shape.ffn_size, d), "matrix"),
            TensorSpec(p + "ffn_down.weight", (d, shape.ffn_size), "matrix"),
        ]
    specs.append(TensorSpec("output_norm.weight", (d,), "norm"))
    if not shape.tied_embeddings:
        specs.append(TensorSpec("output.weight", (shape.vocab_size, d), "matrix"))
    return specs


def build_model(
    path: Path,
    shape: ModelShape,
    *,
    add_tokenizer: Callable[[gguf.GGUFWriter], None],
    chat_template: str | None,
    seed: int = 0,
    description: str = "random weights",
    progress: Callable[[int, int], None] | None = None,
    pooled: bool = False,
) -> None:
    """Write a random-weight Q8_0 model of `shape` to `path` (atomically: a temporary file, then rename).

    `add_tokenizer` writes the tokenizer fields; `progress(done_bytes, total_bytes)` reports the write.
    `pooled` copies every matrix from one pool of random blocks at random offsets instead of drawing each
    value (benchmark files: a 27B-shaped file is written at disk speed; the kernels' work is the same).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        _write_model(partial, shape, add_tokenizer, chat_template, seed, description, progress, pooled)
    except BaseException:  # a full disk or an interrupt: no half-written file (tens of GB) is left behind
        partial.unlink(missing_ok=True)
        raise
    partial.replace(path)


def _write_model(
    partial: Path,
    shape: ModelShape,
    add_tokenizer: Callable[[gguf.GGUFWriter], None],
    chat_template: str | None,
    seed: int,
    description: str,
    progress: Callable[[int, int], None] | None,
    pooled: bool,
) -> None:
    writer = gguf.GGUFWriter(partial, ARCHITECTURE)
    _add_metadata(writer, shape, description)
    add_tokenizer(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    specs = tensor_specs(shape)
    for spec in specs:
        dtype, nbytes, raw_type = _storage(spec)
        writer.add_tensor_info(spec.name, _stored_shape(spec), dtype, nbytes, raw_dtype=raw_type)
    total = sum(_storage(spec)[1] for spec in specs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for data in _random_tensors(specs, shape, seed, pooled):
        writer.write_tensor_data(data)
        done += data.nbytes
        if progress is not None:
            progress(done, total)
    writer.close()


def _add_metadata(writer: gguf.GGUFWriter, shape: ModelShape, description: str) -> None:
    writer.add_name(f"cmpchat random Qwen3.5 {shape.name}")
    writer.add_description(description)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.ffn_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.rope_dims)
    writer.add_rope_dimension_sections(list(shape.rope_sections))
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_full_attention_interval(shape.full_attention_interval)
    writer.add_ssm_conv_kernel(shape.conv_kernel)
    writer.add_ssm_state_size(shape.k_head_dim)
    writer.add_ssm_group_count(shape.num_k_heads)
    writer.add_ssm_time_step_rank(shape.num_v_heads)
    writer.add_ssm_inner_size(shape.num_v_heads * shape.v_head_dim)


def _storage(spec: TensorSpec) -> tuple[np.dtype, int, gguf.GGMLQuantizationType | None]:
    """Matrices are Q8_0 (raw bytes); everything else F32, as in a llama.cpp Q8_0 file."""
    if spec.role == "matrix":
        rows, cols = spec.shape
        return np.dtype(np.uint8), rows * cols // Q8_0_BLOCK * Q8_0_BLOCK_BYTES, gguf.GGMLQuantizationType.Q8_0
    return np.dtype(np.float32), 4 * int(np.prod(spec.shape)), None


def _stored_shape(spec: TensorSpec) -> tuple[int, ...]:
    if spec.role == "matrix":
        rows, cols = spec.shape
        return (rows, cols // Q8_0_BLOCK * Q8_0_BLOCK_BYTES)
    return spec.shape


POOL_BLOCKS = 1 << 21
"""Q8_0 blocks in the pool `pooled` files copy from (68 MB)."""


def _random_tensors(specs: list[TensorSpec], shape: ModelShape, seed: int, pooled: bool) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    pool = _random_q8_0(rng, POOL_BLOCKS // 128, 128 * Q8_0_BLOCK).reshape(-1, Q8_0_BLOCK_BYTES) if pooled else None
    for spec in specs:
        if spec.role == "matrix" and pool is not None:
            yield _pooled_q8_0(rng, pool, *spec.shape)
        elif spec.role == "matrix":
            yield _random_q8_0(rng, *spec.shape)
        elif spec.role == "norm":
            yield (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
        elif spec.role == "conv":
            yield (rng.standard_normal(spec.shape) / np.sqrt(shape.conv_kernel)).astype(np.float32)
        elif spec.role == "decay":
            yield (-np.exp(rng.uniform(-2.0, 1.0, spec.shape))).astype(np.float32)
        else:
            yield rng.uniform(-1.0, 1.0, spec.shape).astype(np.float32)


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 bytes with values of standard deviation ~1/sqrt(cols), generated directly as blocks."""
    blocks = cols // Q8_0_BLOCK
    out = np.empty((rows, blocks, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    # Uniform int8 in [-127, 127] has std 127/sqrt(3); scale it to std 1/sqrt(cols), jittered per block.
    base = np.sqrt(3.0 / cols) / 127.0
    scales = (base * rng.uniform(0.5, 1.5, (rows, blocks))).astype(np.float16)
    out[:, :, :2] = scales[..., None].view(np.uint8).reshape(rows, blocks, 2)
    out[:, :, 2:] = rng.integers(-127, 128, (rows, blocks, Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, blocks * Q8_0_BLOCK_BYTES)


def _pooled_q8_0(rng: np.random.Generator, pool: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes copied from `pool` (blocks) in runs of up to half the pool, each at a random offset."""
    blocks = rows * (cols // Q8_0_BLOCK)
    out = np.empty((blocks, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    run = len(pool) // 2
    for start in range(0, blocks, run):
        count = min(run, blocks - start)
        offset = int(rng.integers(0, len(pool) - count + 1))
        out[start : start + count] = pool[offset : offset + count]
    return out.reshape(rows, -1)
