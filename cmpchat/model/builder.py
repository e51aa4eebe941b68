"""Writes random-weight Qwen3.5 GGUF files: the demo model and files with the shapes of the released sizes.

One builder serves both: the demo model that every front end runs on a fresh machine, and the benchmark
files that llama.cpp can load too. Tensors are generated and written one at a time, so a 27B-shaped file
never needs more than one tensor in memory. Weights are random: such a model's output is random text.

Matrices are Q8_0 by default; `mix` writes llama.cpp's Q4_K_M or Q5_K_M type mix instead (`matrix_types`:
the rules of llama-quantize for these mixes, as they fall on this architecture), or any type per tensor.
Blocks are generated directly as valid random blocks of their type, with values of standard deviation about
1/sqrt(inputs), never by quantising floats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from cmpchat.model.dequant import BLOCK_FORMATS, QK_K, dequantize_rows, row_bytes
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


MIXES: dict[str, tuple[T, T, gguf.LlamaFileType]] = {
    "Q8_0": (T.Q8_0, T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_K_M": (T.Q4_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (T.Q5_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
}
"""Mix name -> (the type of most matrices, the type of the ones given more bits, general.file_type)."""

FALLBACKS = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
"""llama-quantize's type for a matrix whose rows are not whole 256-value blocks."""


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of the layers whose attention values and FFN down projection get more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def matrix_types(shape: ModelShape, mix: str) -> dict[str, T]:
    """The type of every matrix in a file of `shape` quantised to `mix` by llama-quantize (no importance matrix).

    The output head (or the tied embedding, which is also the head) takes the high type; a layer's
    attention values (attn_v, or a GDN layer's attn_qkv, which llama.cpp counts alike) and its FFN down
    projection take it in the first and last eighth of the layers and every third layer between; every other
    matrix, the untied embedding included, the base type. The conv weights and the norms are not quantised.
    A matrix whose rows are not whole 256-value blocks falls back to a 32-value type (Q4_K -> Q5_0,
    Q5_K -> Q5_1, Q6_K -> Q8_0), as llama-quantize does.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose one of {', '.join(MIXES)}")
    base, high, _ = MIXES[mix]
    types = {}
    for spec in tensor_specs(shape):
        if spec.role != "matrix":
            continue
        layer = int(spec.name.split(".")[1]) if spec.name.startswith("blk.") else None
        head = spec.name == "output.weight" or (spec.name == "token_embd.weight" and shape.tied_embeddings)
        role = spec.name.rsplit(".", 2)[-2]
        more = layer is not None and role in ("attn_v", "attn_qkv", "ffn_down") and _more_bits(layer, shape.num_layers)
        chosen = high if head or more else base
        if spec.shape[1] % QK_K and chosen in FALLBACKS:
            chosen = FALLBACKS[chosen]
        types[spec.name] = chosen
    return types


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
    mix: str | Mapping[str, T] = "Q8_0",
    as_f32: bool = False,
) -> None:
    """Write a random-weight model of `shape` to `path` (atomically: a temporary file, then rename).

    `add_tokenizer` writes the tokenizer fields; `progress(done_bytes, total_bytes)` reports the write.
    `pooled` copies every matrix from one pool of random blocks at random offsets instead of drawing each
    value (benchmark files: a 27B-shaped file is written at disk speed; the kernels' work is the same).
    `mix` is a name in MIXES (llama.cpp's type mix for it, `matrix_types`) or a type per matrix name (Q8_0 for
    those it leaves out). `as_f32` writes the same model with every matrix stored as the exact F32 values of
    the blocks it would have held (the same seed draws the same blocks), for comparing a quantised file with it.
    """
    types = _resolve_mix(shape, mix)
    if as_f32:
        file_type = gguf.LlamaFileType.ALL_F32
    elif isinstance(mix, str):
        file_type = MIXES[mix][2]
    else:
        file_type = None
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    layout = _Layout(types, as_f32, file_type)
    try:
        _write_model(partial, shape, add_tokenizer, chat_template, seed, description, progress, pooled, layout)
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
    layout: _Layout,
) -> None:
    writer = gguf.GGUFWriter(partial, ARCHITECTURE)
    _add_metadata(writer, shape, description, layout.file_type)
    add_tokenizer(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    specs = tensor_specs(shape)
    for spec in specs:
        dtype, nbytes, raw_type = layout.storage(spec)
        writer.add_tensor_info(spec.name, layout.stored_shape(spec), dtype, nbytes, raw_dtype=raw_type)
    total = sum(layout.storage(spec)[1] for spec in specs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for data in _random_tensors(specs, shape, seed, pooled, layout):
        writer.write_tensor_data(data)
        done += data.nbytes
        if progress is not None:
            progress(done, total)
    writer.close()


def _add_metadata(
    writer: gguf.GGUFWriter, shape: ModelShape, description: str, file_type: gguf.LlamaFileType | None
) -> None:
    writer.add_name(f"cmpchat random Qwen3.5 {shape.name}")
    writer.add_description(description)
    if file_type is not None:
        writer.add_file_type(file_type)
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


def _resolve_mix(shape: ModelShape, mix: str | Mapping[str, T]) -> dict[str, T]:
    if isinstance(mix, str):
        return matrix_types(shape, mix)
    types = {spec.name: mix.get(spec.name, T.Q8_0) for spec in tensor_specs(shape) if spec.role == "matrix"}
    unknown = set(mix) - set(types)
    if unknown:
        raise ValueError(f"not matrices of this shape: {', '.join(sorted(unknown))}")
    widths = {spec.name: spec.shape[-1] for spec in tensor_specs(shape)}
    for name, tensor_type in types.items():
        if tensor_type not in BLOCK_FORMATS:
            raise ValueError(f"{name}: the builder writes block types only, not {tensor_type.name}")
        if widths[name] % BLOCK_FORMATS[tensor_type].values:
            raise ValueError(f"{name}: rows of {widths[name]} are not whole {tensor_type.name} blocks")
    return types


@dataclass(frozen=True)
class _Layout:
    """How each tensor is stored: matrices in their block type (or as F32 with `as_f32`), the rest F32, as in
    a llama.cpp file."""

    types: dict[str, T]
    as_f32: bool
    file_type: gguf.LlamaFileType | None

    def storage(self, spec: TensorSpec) -> tuple[np.dtype, int, T | None]:
        if spec.role == "matrix" and not self.as_f32:
            rows, cols = spec.shape
            return np.dtype(np.uint8), rows * row_bytes(self.types[spec.name], cols), self.types[spec.name]
        return np.dtype(np.float32), 4 * int(np.prod(spec.shape)), None

    def stored_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        if spec.role == "matrix" and not self.as_f32:
            rows, cols = spec.shape
            return (rows, row_bytes(self.types[spec.name], cols))
        return spec.shape


POOL_BLOCKS = 1 << 21
"""Q8_0 blocks in the pool `pooled` files copy from (68 MB)."""


POOL_BYTES = 64 << 20
"""Bytes in the pool of each other block type (made when a file first needs that type)."""


def _random_tensors(
    specs: list[TensorSpec], shape: ModelShape, seed: int, pooled: bool, layout: _Layout
) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    pools: dict[T, np.ndarray] = {}
    if pooled and T.Q8_0 in layout.types.values():
        pools[T.Q8_0] = _random_q8_0(rng, POOL_BLOCKS // 128, 128 * Q8_0_BLOCK).reshape(-1, Q8_0_BLOCK_BYTES)
    for spec in specs:
        if spec.role == "matrix":
            tensor_type = layout.types[spec.name]
            rows, cols = spec.shape
            if pooled:
                if tensor_type not in pools:
                    block = BLOCK_FORMATS[tensor_type]
                    count = POOL_BYTES // block.nbytes
                    pool = random_blocks(rng, tensor_type, 1, count * block.values, cols=4096)
                    pools[tensor_type] = pool.reshape(count, block.nbytes)
                blocks = _pooled_blocks(rng, pools[tensor_type], rows, cols // BLOCK_FORMATS[tensor_type].values)
            elif tensor_type == T.Q8_0:
                blocks = _random_q8_0(rng, rows, cols)
            else:
                blocks = random_blocks(rng, tensor_type, rows, cols)
            yield dequantize_rows(blocks, tensor_type, cols) if layout.as_f32 else blocks
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


def _pooled_blocks(rng: np.random.Generator, pool: np.ndarray, rows: int, blocks_per_row: int) -> np.ndarray:
    """Rows of blocks copied from `pool` ([blocks, block bytes]) in runs of up to half the pool, each at a
    random offset."""
    blocks = rows * blocks_per_row
    out = np.empty((blocks, pool.shape[1]), dtype=np.uint8)
    run = len(pool) // 2
    for start in range(0, blocks, run):
        count = min(run, blocks - start)
        offset = int(rng.integers(0, len(pool) - count + 1))
        out[start : start + count] = pool[offset : offset + count]
    return out.reshape(rows, -1)


def random_blocks(
    rng: np.random.Generator, tensor_type: T, rows: int, values: int, *, cols: int | None = None
) -> np.ndarray:
    """Random valid blocks of `tensor_type` for `rows` rows of `values` values, uint8 [rows, row bytes], whose
    values have a standard deviation of about 1/sqrt(cols) (cols: `values` unless given) and mean about 0.

    The quants are random bytes; the fp16 scales are set so the integer levels map to that spread (jittered
    per block), with the minimums of Q4_1 / Q5_1 / Q4_K / Q5_K centring each block or sub-block. Q8_0 is
    `_random_q8_0`'s (the demo model's files stay as they were).
    """
    block = BLOCK_FORMATS[tensor_type]
    n = rows * (values // block.values)
    sigma = 1.0 / np.sqrt(cols or values)
    out = rng.integers(0, 256, (n, block.nbytes), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, n)

    def put_f16(offset: int, value: np.ndarray) -> None:
        out[:, offset : offset + 2] = value.astype(np.float16)[:, None].view(np.uint8)

    uniform_std = {16: np.sqrt((16**2 - 1) / 12), 32: np.sqrt((32**2 - 1) / 12)}  # of q over 16 or 32 levels
    iq4_std = float(np.sqrt(np.mean(np.square(_IQ4_LEVELS))))
    if tensor_type in (T.Q4_0, T.Q5_0):
        put_f16(0, sigma / uniform_std[16 if tensor_type == T.Q4_0 else 32] * jitter)
    elif tensor_type in (T.Q4_1, T.Q5_1):
        levels = 16 if tensor_type == T.Q4_1 else 32
        d = sigma / uniform_std[levels] * jitter
        put_f16(0, d)
        put_f16(2, -d.astype(np.float16).astype(np.float64) * (levels - 1) / 2)
    elif tensor_type == T.Q8_0:
        return _random_q8_0(rng, rows, values)
    elif tensor_type in (T.Q4_K, T.Q5_K):
        levels = 16 if tensor_type == T.Q4_K else 32
        scales = rng.integers(32, 64, (n, 8))  # 6-bit sub-block scales, kept large so the minimums can centre
        mins = np.rint(scales * ((levels - 1) / 2) / 32).astype(np.int64)  # dmin = 32 d: m / sc ~ centre / 32
        d = sigma / (uniform_std[levels] * 48) * jitter
        put_f16(0, d)
        put_f16(2, d * 32)
        out[:, 4:16] = pack_k_scales(scales, mins)
    elif tensor_type == T.Q6_K:
        scales = rng.integers(64, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))
        out[:, 192:208] = scales.astype(np.int8).view(np.uint8)
        put_f16(208, sigma / (uniform_std[16] * 4 * 96) * jitter)  # 64 levels: std ~ 4x that of 16
    elif tensor_type == T.IQ4_NL:
        put_f16(0, sigma / iq4_std * jitter)
    elif tensor_type == T.IQ4_XS:
        low = rng.integers(40, 64, (n, 8))  # 6-bit scales ls, ls - 32 in 8..31
        out[:, 2:4] = ((low >> 4) << (2 * np.arange(8))).sum(axis=1).astype("<u2")[:, None].view(np.uint8)
        nibbles = (low & 15).reshape(n, 4, 2)
        out[:, 4:8] = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).astype(np.uint8)
        put_f16(0, sigma / (iq4_std * 20) * jitter)
    else:
        raise ValueError(f"no random blocks for {tensor_type.name}")
    return out.reshape(rows, -1)


_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 scale bytes for 8 six-bit scales and mins per block ([n, 8] each): bytes 0-3 hold
    sub-blocks 0-3's scales and 4-7 their mins in their low 6 bits, bytes 8-11 sub-blocks 4-7's low 4 bits
    (scale in the low nibble, min in the high), whose top 2 bits go to the top of bytes 0-3 (scales) and 4-7
    (mins); `cmpchat.model.dequant` reads them back."""
    scales = scales.astype(np.uint8)
    mins = mins.astype(np.uint8)
    out = np.empty((len(scales), 12), dtype=np.uint8)
    out[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    out[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    out[:, 8:12] = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return out
