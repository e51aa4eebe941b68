"""The model's weights on the GPU, streamed from the mapped file one piece at a time.

Matrices that read the same input are stacked into one ("fused") matrix so one GEMV launch reads that
input once: attention q|k|v, GDN qkv|gate|beta|alpha, FFN gate|up. Q8_0 matrices are stored as quants
(uint32 words, 4 int8 each) and fp16 scales apart; the 4/5/6-bit types in the layout of
`kernels/gemv_kquant.py`; F16/BF16/F32 matrices keep their type. A fused matrix whose parts have different
4/5/6-bit types (a Q4_K_M file's q|k Q4_K with v Q6_K) is held as parts, one launch each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from cmpchat.backends.gpu.memory_plan import HOST_CHUNK_BYTES
from cmpchat.backends.gpu.repack import kquant_row_chunks, q8_0_row_chunks
from cmpchat.errors import CmpchatError
from cmpchat.kernels.gemv_kquant import ARRAY_DTYPES, FORMATS, KQUANT_TYPES, KQuantArrays
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile

Progress = Callable[[int], None]
"""Called with the number of bytes just uploaded."""


@dataclass
class DeviceMatrix:
    """One (possibly fused) weight matrix on the GPU, [rows, cols] in numpy order."""

    rows: int
    cols: int
    tensor_type: GGMLQuantizationType | None  # None: parts of different types
    quants: Any = None  # Q8_0: uint32 [rows, cols/4]
    scales: Any = None  # Q8_0: float16 [rows, cols/32]
    dense: Any = None  # F32: float32 [rows, cols]; F16/BF16: uint16 bits [rows, cols]
    kquant: KQuantArrays | None = None  # the 4/5/6-bit types' arrays
    parts: tuple[DeviceMatrix, ...] = ()  # stacked along rows, in order, when their types differ

    @property
    def is_q8_0(self) -> bool:
        return self.tensor_type == GGMLQuantizationType.Q8_0


def upload_matrix(
    model_file: ModelFile, names: Sequence[str], progress: Progress, *, one_type: bool = False
) -> DeviceMatrix:
    """Stack the matrices `names` along rows into one device matrix. All must share their width, and their type
    unless they are all 4/5/6-bit types and `one_type` is not asked for (a SwiGLU gate|up needs one type: its
    kernel reads a gate row and its up row side by side); then runs of one type become parts."""
    infos = [model_file.tensor_info(name) for name in names]
    types = [info.type for info in infos]
    widths = {info.shape[1] for info in infos}
    mixable = not one_type and all(t in KQUANT_TYPES for t in types)
    if len(widths) != 1 or (len(set(types)) != 1 and not mixable):
        listing = ", ".join(f"{i.name} ({i.type_name}, {i.shape[1]} wide)" for i in infos)
        need = "one width" if len(widths) != 1 else "one type (or 4/5/6-bit types only, outside a gate|up pair)"
        raise CmpchatError(f"{model_file.path.name}: {listing} must share {need} for the GPU backend")
    runs: list[list[str]] = []
    for info, previous in zip(infos, [None, *types[:-1]], strict=True):
        if info.type != previous:
            runs.append([])
        runs[-1].append(info.name)
    parts = [_upload_one_type(model_file, run, progress) for run in runs]
    if len(parts) == 1:
        return parts[0]
    return DeviceMatrix(sum(p.rows for p in parts), widths.pop(), None, parts=tuple(parts))


def _upload_one_type(model_file: ModelFile, names: Sequence[str], progress: Progress) -> DeviceMatrix:
    infos = [model_file.tensor_info(name) for name in names]
    tensor_type, cols = infos[0].type, infos[0].shape[1]
    rows = sum(info.shape[0] for info in infos)
    matrix = DeviceMatrix(rows, cols, tensor_type)
    if tensor_type == GGMLQuantizationType.Q8_0:
        matrix.quants = cuda.device_array((rows, cols // 4), dtype=np.uint32)
        matrix.scales = cuda.device_array((rows, cols // 32), dtype=np.float16)
    elif tensor_type in FORMATS:
        shapes = FORMATS[tensor_type].shapes(rows, cols)
        matrix.kquant = KQuantArrays(
            **{
                name: cuda.device_array(shape, ARRAY_DTYPES[name]) if shape[0] == rows
                else cuda.to_device(np.zeros(shape, ARRAY_DTYPES[name]))  # a placeholder the type has no use for
                for name, shape in shapes.items()
            }
        )  # fmt: skip
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
        elif matrix.kquant is not None:
            for rows_chunk in kquant_row_chunks(model_file, info.name, HOST_CHUNK_BYTES):
                start = first + rows_chunk.first_row
                uploaded = 0
                for name in ARRAY_DTYPES:
                    host, device = getattr(rows_chunk.arrays, name), getattr(matrix.kquant, name)
                    if device.shape[0] == rows:  # not a placeholder
                        device[start : start + host.shape[0]].copy_to_device(host)
                        uploaded += host.nbytes
                progress(uploaded)
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
    *KQUANT_TYPES,
)
"""The tensor types the CUDA kernels multiply; the reader (and the CPU backend) reads more (`model/dequant.py`)."""


def check_gpu_types(model_file: ModelFile, config: ModelConfig) -> None:
    """Refuse, in one line and before anything touches a GPU, a file with a tensor the CUDA backend cannot run
    (IQ types, TQ, MXFP4, ...), a float token embedding (the embedding lookup reads Q8_0 and the 4/5/6-bit
    types), or a layer whose ffn_gate and ffn_up differ in type (the SwiGLU GEMV reads both rows with one
    kernel). MTP blocks, which are never loaded, are not looked at."""
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
            f"not run (it runs {', '.join(t.name for t in GPU_TYPES)}); the CPU backend reads it: --backend cpu"
        )
    embedding = model_file.tensor_info("token_embd.weight")
    if embedding.type != GGMLQuantizationType.Q8_0 and embedding.type not in KQUANT_TYPES:
        raise CmpchatError(
            f"{model_file.path.name}: tensor 'token_embd.weight' is {embedding.type_name}; the CUDA backend's "
            "embedding lookup reads Q8_0 and the 4/5/6-bit types; the CPU backend reads it: --backend cpu"
        )
    for i in layers:
        gate, up = (model_file.tensor_info(f"blk.{i}.ffn_{part}.weight") for part in ("gate", "up"))
        if gate.type != up.type:
            raise CmpchatError(
                f"{model_file.path.name}: {gate.name} is {gate.type_name} but {up.name} is {up.type_name}; the "
                "CUDA backend's SwiGLU GEMV needs one type for both; the CPU backend reads it: --backend cpu"
            )


def _type_list(infos: Sequence[Any]) -> str:
    return ", ".join(sorted({info.type_name for info in infos}))


def stage_weight_bytes(model_file: ModelFile, config: ModelConfig, layers: range, *, first: bool, last: bool) -> int:
    """GPU bytes of what `upload_stage_weights` uploads for this stage, as repacked (Q8_0 keeps 34 bytes per 32;
    the 4/5/6-bit types `KQuantFormat.matrix_bytes`)."""
    total = sum(_gpu_bytes(model_file, name) for name in model_file.tensors if _layer_of(name) in layers)
    if first:
        total += _gpu_bytes(model_file, "token_embd.weight")
    if last:
        total += _gpu_bytes(model_file, "output_norm.weight")
        head = "token_embd.weight" if config.tied_embeddings else "output.weight"
        if not (first and config.tied_embeddings):
            total += _gpu_bytes(model_file, head)
    return total


def _gpu_bytes(model_file: ModelFile, name: str) -> int:
    info = model_file.tensor_info(name)
    if info.type in FORMATS:
        return FORMATS[info.type].matrix_bytes(math.prod(info.shape[:-1]), info.shape[-1])
    return info.n_bytes


def _layer_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])


def upload_stage_weights(
    model_file: ModelFile, config: ModelConfig, layers: range, *, first: bool, last: bool, progress: Progress
) -> StageWeights:
    """Every weight a stage's steps read, one tensor (or row chunk) in host memory at a time (the types checked
    first: `check_gpu_types`)."""
    embedding = None
    if first:
        embedding = upload_matrix(model_file, ["token_embd.weight"], progress)
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
        gate_up=upload_matrix(model_file, [p + "ffn_gate.weight", p + "ffn_up.weight"], progress, one_type=True),
        down=upload_matrix(model_file, [p + "ffn_down.weight"], progress),
    )
