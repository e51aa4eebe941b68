"""The tensor-core probe behind `cmpchat doctor --tensor-cores`: the one kernel that issues tensor-core math.

The CMP 100-210 throttles its tensor cores 64× (docs/hardware.md), so no engine kernel may use them: the PTX and
SASS checks fail every kernel with a tensor-core instruction except those their allow-list names
(`ptx_check.TENSOR_CORE_PROBE_KERNELS`), which is this module's `mma_chains` alone. It measures how fast the
card runs them, so the doctor can say whether they are throttled; it runs only when asked for.

The instruction is `wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32` (fp16 inputs, fp32 accumulators): the
one fp16 shape every tensor-core GPU runs natively, from sm_70 (HMMA.884) to sm_90 (HMMA.16816). `mma.sync`
m8n8k4, sm_70's own shape, is no fit: on an H200 ptxas emulates it without HMMA, at 16 TFLOPS where
m16n8k16 reaches 645. Each warp-wide instruction does 16 × 16 × 16 multiply-adds, counted as 8192 flops.
A wmma fragment's layout is unspecified, so the probe fills A and B with one value each: every element of D
then gains 16 products per step, wherever it sits.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import SIMULATOR, WARP_SIZE
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.throughput_probes import calibrated_rate, probe_grid

MMA_CHAINS = 4
"""Independent accumulator fragments (8 fp32 registers each) per thread."""
FLOPS_PER_MMA = 2 * 16 * 16 * 16
"""Per warp-wide m16n16k16 instruction."""
FP16_ONES = 0x3C003C00
"""Two fp16 1.0 in one word."""

if SIMULATOR:

    @cuda.jit(device=True)
    def mma_uniform(a, b, c):
        raise NotImplementedError("the CUDA simulator has no tensor cores")

else:
    from llvmlite import ir
    from numba import types, uint32
    from numba.cuda.extending import intrinsic

    _ACCUMULATORS = types.UniTuple(float32, 8)

    @intrinsic
    def mma_uniform(typingctx, a, b, c):
        """D = A·B + C for the warp's 16×16 fp32 accumulator fragment c, every fp16 element of A being the
        low (= high) half of word a and every element of B that of word b (fragments of 8 such words)."""
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer) and c == _ACCUMULATORS):
            return None

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            accumulators = [builder.extract_value(args[2], i) for i in range(8)]
            registers = ", ".join("{" + ",".join(f"${8 * group + i}" for i in range(8)) + "}" for group in range(4))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([f32] * 8), [i32] * 16 + [f32] * 8),
                f"wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {registers};",
                ",".join(["=f"] * 8 + ["r"] * 16 + ["f"] * 8),
            )
            product = builder.call(asm, [args[0]] * 8 + [args[1]] * 8 + accumulators)
            values = [builder.extract_value(product, i) for i in range(8)]
            return context.make_tuple(builder, sig.return_type, values)

        return _ACCUMULATORS(uint32, uint32, _ACCUMULATORS), codegen


@kernel("void(uint32[::1], int32, float32[::1])")
def mma_chains(inputs, iterations, out):
    """Four chains D = A·B + D, from D = 0, `iterations` steps each, A filled with the fp16 pair inputs[0]
    and B with inputs[1]; out[thread] = Σ of the thread's 32 accumulators (launch whole warps)."""
    a, b = inputs[0], inputs[1]
    zero = float32(0)
    acc0 = acc1 = acc2 = acc3 = (zero, zero, zero, zero, zero, zero, zero, zero)
    step = 0
    while step < iterations:
        acc0 = mma_uniform(a, b, acc0)
        acc1 = mma_uniform(a, b, acc1)
        acc2 = mma_uniform(a, b, acc2)
        acc3 = mma_uniform(a, b, acc3)
        step += 1
    total = zero
    for chain in (acc0, acc1, acc2, acc3):
        for value in chain:
            total += value
    i = cuda.grid(1)
    if i < out.size:
        out[i] = total


def mma_rate(seconds_per_launch: float = 0.005, repeats: int = 10) -> float:
    """Flops/s of fp16 m16n16k16 tensor-core products with fp32 accumulators on the current GPU."""
    blocks, threads = probe_grid()
    inputs = cuda.to_device(np.full(2, FP16_ONES, np.uint32))
    out = cuda.device_array(blocks * threads, np.float32)

    def launch_for(iterations: int) -> Launch:
        return Launch(mma_chains, blocks, threads, (inputs, np.int32(iterations), out))

    flops_per_iteration = blocks * threads // WARP_SIZE * MMA_CHAINS * FLOPS_PER_MMA
    return calibrated_rate(launch_for, flops_per_iteration, seconds_per_launch, repeats)
