"""The model's weights on the GPU, streamed from the mapped file one piece at a time.

Matrices that read the same input are stacked into one ("fused") matrix so one GEMV launch reads that
input once: attention q|k|v, GDN qkv|gate|beta|alpha, FFN gate|up. Q8_0 matrices are stored as quants
(uint32 words, 4 int8 each) and fp16 scales apart; F16/BF16/F32 matrices keep their type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.backends.gpu.memory_plan import HOST_CHUNK_BYTES
from cmpchat.backends.gpu.repack import q8_0_row_chunks
from cmpchat.errors import CmpchatError
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile

Progress = Callable[[int], None]
"""Called with the number of bytes just uploaded."""


@dataclass
class DeviceMatrix:
    """One (possibly fused) weight matrix on the GPU, [rows, cols] in numpy order."""

    rows: int
    cols: int
    tensor_type: GGMLQuantizationType
    quants: Any = None  # Q8_0: uint32 [rows, cols/4]
    scales: Any = None  # Q8_0: float16 [rows, cols/32]
    dense: Any = None  # F32: float32 [rows, cols]; F16/BF16: uint16 bits [rows, cols]

    @property
    def is_q8_0(self) -> bool:
        return self.tensor_type == GGMLQuantizationType.Q8_0


def upload_matrix(model_file: ModelFile, names: Sequence[str], progress: Progress) -> DeviceMatrix:
    """Stack the matrices `names` along rows into one device matrix (all must share type and width)."""
    infos = [model_file.tensor_info(name) for name in names]
    types = {info.type for info in infos}
    widths = {info.shape[1] for info in infos}
    if len(types) != 1 or len(widths) != 1:
        listing = ", ".join(f"{i.name} ({i.type_name}, {i.shape[1]} wide)" for i in infos)
        raise CmpchatError(
            f"{model_file.path.name}: {listing} must share one type and width for the GPU backend; "
            "use a plain Q8_0 file"
        )
    tensor_type, cols = types.pop(), widths.pop()
    rows = sum(info.shape[0] for info in infos)
    matrix = DeviceMatrix(rows, cols, tensor_type)
    if tensor_type == GGMLQuantizationType.Q8_0:
        matrix.quants = cuda.device_array((rows, cols // 4), dtype=np.uint32)
        matrix.scales = cuda.device_array((rows, cols // 32), dtype=np.float16)
    else:
        dtype = np.float32 if tensor_type == GGMLQuantizationType.F32 else np.uint16
        matrix.dense = cuda.device_array((rows, cols), dtype=dtype)
    first = 0
    for info in infos:
        if matrix.is_q8_0:
            for chunk in q8_0_row_chunks(model_file, info.name, HOST_CHUNK_BYTES):
                start = first + chunk.first_row
                stop = start + chunk.quants.shape[0]
                matrix.quants[start:stop].copy_to_device(chunk.quants.view(np.uint32))
                matrix.scales[start:stop].copy_to_device(chunk.scales)
                progress(chunk.quants.nbytes + chunk.scales.nbytes)
        else:
            raw = model_file.raw(info.name).view(matrix.dense.dtype).reshape(info.shape)
            step = max(1, HOST_CHUNK_BYTES // (cols * raw.itemsize))
            for row in range(0, info.shape[0], step):
                piece = np.ascontiguousarray(raw[row : row + step])
                matrix.dense[first + row : first + row + piece.shape[0]].copy_to_device(piece)
                progress(piece.nbytes)
        first += info.shape[0]
    return matrix


def upload_vector(model_file: ModelFile, name: str, progress: Progress, shape: tuple[int, ...] | None = None) -> Any:
    values = np.ascontiguousarray(model_file.dequantize(name), dtype=np.float32)
    if shape is not None:
        values = values.reshape(shape)
    progress(values.nbytes)
    return cuda.to_device(values)


@dataclass
class AttentionWeights:
    qkv: DeviceMatrix  # rows [q&gate interleaved per head | k | v]
    output: DeviceMatrix
    q_norm: Any
    k_norm: Any


@dataclass
class RecurrentWeights:
    projection: DeviceMatrix  # rows [qkv | z | beta | alpha]
    output: DeviceMatrix
    conv_weight: Any  # float32 [conv_dim, K]
    ssm_a: Any
    dt_bias: Any
    norm_weight: Any


@dataclass
class LayerWeights:
    kind: LayerKind
    mixer_norm: Any
    mlp_norm: Any
    mixer: AttentionWeights | RecurrentWeights
    gate_up: DeviceMatrix  # rows [gate | up]
    down: DeviceMatrix


@dataclass
class StageWeights:
    """What one pipeline stage holds: its layers, plus the embedding on the first stage and the output norm
    and LM head on the last (a tied LM head is the embedding matrix; a stage holding both shares it)."""

    layers: dict[int, LayerWeights]
    """global layer index -> weights, in order"""
    embedding: DeviceMatrix | None
    output_norm: Any
    lm_head: DeviceMatrix | None


GPU_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
)
"""The tensor types the CUDA kernels multiply; the reader (and the CPU backend) reads more (`model/dequant.py`)."""


def check_gpu_types(model_file: ModelFile, config: ModelConfig) -> None:
    """Refuse, in one line and before anything touches a GPU, a file with a tensor the CUDA backend cannot run
    yet (the k-quants and 4/5-bit types: their GPU kernels are issue 30's next part). MTP blocks, which are
    never loaded, are not looked at."""
    layers = range(config.num_layers)
    others = [
        info
        for name, info in model_file.tensors.items()
        if info.type not in GPU_TYPES and (not name.startswith("blk.") or _layer_of(name) in layers)
    ]
    if others:
        first = others[0]
        rest = f" (and {len(others) - 1} more tensors: {_type_list(others)})" if len(others) > 1 else ""
        raise CmpchatError(
            f"{model_file.path.name}: tensor '{first.name}' is {first.type_name}{rest}, which the CUDA backend does "
            f"not run yet (it runs {', '.join(t.name for t in GPU_TYPES)}; GPU support for the others is coming); "
            "the CPU backend reads it: --backend cpu"
        )


def _type_list(infos: Sequence[Any]) -> str:
    return ", ".join(sorted({info.type_name for info in infos}))


def stage_weight_bytes(model_file: ModelFile, config: ModelConfig, layers: range, *, first: bool, last: bool) -> int:
    """GPU bytes of what `upload_stage_weights` uploads for this stage (as stored: Q8_0 keeps 34 bytes per 32)."""
    total = sum(info.n_bytes for name, info in model_file.tensors.items() if _layer_of(name) in layers)
    if first:
        total += model_file.tensor_info("token_embd.weight").n_bytes
    if last:
        total += model_file.tensor_info("output_norm.weight").n_bytes
        head = "token_embd.weight" if config.tied_embeddings else "output.weight"
        if not (first and config.tied_embeddings):
            total += model_file.tensor_info(head).n_bytes
    return total


def _layer_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])


def upload_stage_weights(
    model_file: ModelFile, config: ModelConfig, layers: range, *, first: bool, last: bool, progress: Progress
) -> StageWeights:
    """Every weight a stage's steps read, one tensor (or row chunk) in host memory at a time."""
    embedding = None
    if first:
        embedding = upload_matrix(model_file, ["token_embd.weight"], progress)
        if not embedding.is_q8_0:
            raise CmpchatError(
                f"{model_file.path.name}: token_embd.weight is {embedding.tensor_type.name}; "
                "the GPU backend needs a Q8_0 embedding (use a Q8_0 file)"
            )
    uploaded = {i: _upload_layer(model_file, config, i, progress) for i in layers}
    output_norm, lm_head = None, None
    if last:
        output_norm = upload_vector(model_file, "output_norm.weight", progress)
        if config.tied_embeddings:
            lm_head = embedding or upload_matrix(model_file, ["token_embd.weight"], progress)
        else:
            lm_head = upload_matrix(model_file, ["output.weight"], progress)
    return StageWeights(uploaded, embedding, output_norm, lm_head)


def _upload_layer(model_file: ModelFile, config: ModelConfig, i: int, progress: Progress) -> LayerWeights:
    p = f"blk.{i}."
    kind = config.layer_kinds[i]
    if kind is LayerKind.ATTENTION:
        mixer: AttentionWeights | RecurrentWeights = AttentionWeights(
            qkv=upload_matrix(model_file, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], progress),
            output=upload_matrix(model_file, [p + "attn_output.weight"], progress),
            q_norm=upload_vector(model_file, p + "attn_q_norm.weight", progress),
            k_norm=upload_vector(model_file, p + "attn_k_norm.weight", progress),
        )
    else:
        mixer = RecurrentWeights(
            projection=upload_matrix(
                model_file,
                [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight", p + "ssm_alpha.weight"],
                progress,
            ),
            output=upload_matrix(model_file, [p + "ssm_out.weight"], progress),
            conv_weight=upload_vector(
                model_file, p + "ssm_conv1d.weight", progress, (config.conv_dim, config.conv_kernel)
            ),
            ssm_a=upload_vector(model_file, p + "ssm_a", progress),
            dt_bias=upload_vector(model_file, p + "ssm_dt.bias", progress),
            norm_weight=upload_vector(model_file, p + "ssm_norm.weight", progress),
        )
    return LayerWeights(
        kind=kind,
        mixer_norm=upload_vector(model_file, p + "attn_norm.weight", progress),
        mlp_norm=upload_vector(model_file, p + "post_attention_norm.weight", progress),
        mixer=mixer,
        gate_up=upload_matrix(model_file, [p + "ffn_gate.weight", p + "ffn_up.weight"], progress),
        down=upload_matrix(model_file, [p + "ffn_down.weight"], progress),
    )
