"""The 4/5/6-bit matmuls on a GPU (`pytest -m gpu`) at Qwen3.5 9B's shapes: every type on the attention
projection's 4096 x 4096, the FFN's gate|up (SwiGLU) and down in the types a Q4_K_M file gives them, at one
token (the fused kernel a decode step runs, and the batched one), a full tile of 16 and several tiles (a prompt
chunk) for the GEMV, and at a long prompt step's token counts (with tails) for the GEMM in the GPU's and the
CMP's tilings, against float64 numpy of the reader's weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.gemm import SM70_TILING, gemm_kquant_launch
from cmpchat.kernels.gemv_fused import gemv_kquant_fused_launch
from cmpchat.kernels.gemv_kquant import KQUANT_TYPES, KQuantArrays, kquant_matmul_launch
from cmpchat.model.quant import quantize_activations
from tests.kernels.kquant_reference import int8_activations, random_matrix
from tests.kernels.q8_reference import device
from tests.kernels.test_gemv_fused_sim import rms_norm
from tests.kernels.test_gemv_kquant import assert_close, product

pytestmark = pytest.mark.gpu

TOKENS = [1, 16, 37]


def on_device(arrays: KQuantArrays) -> KQuantArrays:
    return KQuantArrays(**{f.name: device(getattr(arrays, f.name)) for f in dataclasses.fields(arrays)})


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_every_type_at_the_9b_attention_shape(tensor_type: T, tokens: int) -> None:
    rng = np.random.default_rng(int(tensor_type) * 7 + tokens)
    rows = cols = 4096
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = device(np.zeros((tokens, rows), np.float32))
    kquant_matmul_launch(tensor_type, on_device(arrays), cols, device(xq), device(xs), out).run()
    assert_close(out.copy_to_host(), *product(raw, arrays, tensor_type, cols, x_values))


@pytest.mark.parametrize("tiling", ["gpu", "sm_70"])
@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_the_gemm_for_every_type_at_the_9b_attention_shape(tensor_type: T, tiling: str) -> None:
    rng = np.random.default_rng(int(tensor_type) * 11)
    rows = cols = 4096
    tokens = 300  # 4 token tiles of 64 and a partial one
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = device(np.zeros((tokens, rows), np.float32))
    chosen = default_tuning(gpu_info(0)).gemm if tiling == "gpu" else SM70_TILING
    gemm_kquant_launch(tensor_type, on_device(arrays), cols, device(xq), device(xs), out, tiling=chosen).run()
    assert_close(out.copy_to_host(), *product(raw, arrays, tensor_type, cols, x_values))


def ffn_launch(tensor_type, arrays, cols, xq, xs, out, mode, tokens):
    """The GEMV up to 16 tokens, the GEMM (the GPU's tiling) above: what a step picks."""
    if tokens <= 16:
        return kquant_matmul_launch(tensor_type, arrays, cols, xq, xs, out, mode=mode)
    return gemm_kquant_launch(
        tensor_type, arrays, cols, xq, xs, out, mode=mode, tiling=default_tuning(gpu_info(0)).gemm
    )


@pytest.mark.parametrize("tokens", [*TOKENS, 512])
def test_the_9b_ffn_as_q4_k_m_gives_it(tokens: int) -> None:
    """gate|up Q4_K through the SwiGLU epilogue, then down Q6_K accumulated into the residual stream."""
    rng = np.random.default_rng(tokens)
    d, f = 4096, 12288
    raw, arrays = random_matrix(rng, T.Q4_K, 2 * f, d)
    xq, xs, x_values = int8_activations(rng, tokens, d)
    expected, magnitude = product(raw, arrays, T.Q4_K, d, x_values)
    gated = device(np.zeros((tokens, f), np.float32))
    ffn_launch(T.Q4_K, on_device(arrays), d, device(xq), device(xs), gated, "swiglu", tokens).run()
    gate, up = expected[:, :f], expected[:, f:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    bound = 1e-5 * (magnitude[:, :f] * np.abs(up) + magnitude[:, f:]) * 4
    assert np.all(np.abs(gated.copy_to_host() - reference) <= bound + 1e-30)

    raw, arrays = random_matrix(rng, T.Q6_K, d, f)
    xq, xs, x_values = int8_activations(rng, tokens, f)
    residual = rng.standard_normal((tokens, d)).astype(np.float32)
    hidden = device(residual)
    ffn_launch(T.Q6_K, on_device(arrays), f, device(xq), device(xs), hidden, "accumulate", tokens).run()
    expected, magnitude = product(raw, arrays, T.Q6_K, f, x_values)
    assert_close(hidden.copy_to_host(), residual + expected, magnitude + 1)


@pytest.mark.parametrize("mode", ["store", "swiglu"])
@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_the_fused_one_token_gemv_at_the_9b_shapes(tensor_type: T, mode: str) -> None:
    """What a decode step runs at one token: RMSNorm and quantisation in the prologue, in the GPU's tiling."""
    rng = np.random.default_rng(int(tensor_type) * 13)
    rows, cols = (4096, 4096) if mode == "store" else (2 * 12288, 4096)
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    out = device(np.zeros((1, rows // 2 if mode == "swiglu" else rows), np.float32))
    gpu = gpu_info(0)
    tiling = default_tuning(gpu).gemv_tiling(rows, cols, mode, gpu.multiprocessors)
    gemv_kquant_fused_launch(tensor_type, on_device(arrays), cols, device(x), out, mode=mode, norm_weight=device(norm),
                             eps=1e-6, sm_count=gpu.multiprocessors, tiling=tiling).run()  # fmt: skip
    quants, scales = quantize_activations(rms_norm(x, norm))
    x_values = (quants.reshape(1, -1, 32).astype(np.float64) * scales[..., None]).reshape(1, cols)
    expected, magnitude = product(raw, arrays, tensor_type, cols, x_values)
    if mode == "store":
        assert_close(out.copy_to_host(), expected, magnitude)
        return
    half = rows // 2
    gate, up = expected[:, :half], expected[:, half:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    bound = 1e-5 * (magnitude[:, :half] * np.abs(up) + magnitude[:, half:]) * 4
    assert np.all(np.abs(out.copy_to_host() - reference) <= bound + 1e-30)
