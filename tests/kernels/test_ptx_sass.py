"""The SASS check: on the GPU, the machine code of every registered kernel has no tensor-core opcode; a kernel
that does use tensor cores is caught (the check is not vacuous). The parser is also tested on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.devtools.sass_check import sass_opcodes, tensor_core_opcodes

SASS = """
	code for sm_90
		Function : _ZN6kernel
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                          /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA 0x70 ;                                  /* 0x0000000000088947 */
        /*0030*/                   IDP.4A.S8.S8 R5, R2, R3, R5 ;               /* 0x0000000302057226 */
        /*0040*/                   HMMA.16816.F32 R4, R8, R12, R4 ;            /* 0x0000000c0804723c */
        /*0050*/              @UP0 HGMMA.64x64x16.F32 R24, gdesc[UR4], R24 ;   /* 0x00000000041879f0 */
        /*0060*/                   EXIT ;                                      /* 0x000000000000794d */
"""


def test_opcodes_are_read_without_modifiers_or_predicates():
    assert sass_opcodes(SASS) == ["LDC", "S2R", "BRA", "IDP", "HMMA", "HGMMA", "EXIT"]


def test_tensor_core_opcodes_are_those_ending_in_mma():
    assert tensor_core_opcodes(SASS) == ["HGMMA", "HMMA"]
    assert tensor_core_opcodes(SASS.replace("HMMA", "FFMA").replace("HGMMA", "FADD")) == []


if not SIMULATOR:
    from llvmlite import ir
    from numba import cuda, float32, types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _mma_16x8x8(typingctx, a0, a1, b0):
        """One warp-wide fp16 tensor-core product (sm_75+), as a control the SASS check must catch."""
        signature = types.UniTuple(float32, 4)(types.int32, types.int32, types.int32)

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            result = ir.LiteralStructType([f32] * 4)
            asm = ir.InlineAsm(
                ir.FunctionType(result, [i32, i32, i32, f32, f32, f32, f32]),
                "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5}, {$6}, {$7,$8,$9,$10};",
                "=f,=f,=f,=f,r,r,r,f,f,f,f",
            )
            zero = ir.Constant(f32, 0.0)
            product = builder.call(asm, [*args, zero, zero, zero, zero])
            parts = [builder.extract_value(product, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return signature, codegen

    def tensor_core_control(a, b, out):
        i = cuda.grid(1)
        d0, d1, d2, d3 = _mma_16x8x8(a[2 * i], a[2 * i + 1], b[i])
        out[i] = d0 + d1 + d2 + d3


@pytest.mark.gpu
def test_no_registered_kernel_has_tensor_core_opcodes_in_its_sass():
    from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels
    from cmpchat.devtools.sass_check import check_kernel, disassembler

    _, failed = import_kernel_modules()
    assert not failed, failed
    command = disassembler()
    reports = [check_kernel(spec, signature, command) for spec in registered_kernels() for signature in spec.signatures]
    assert reports
    problems = {f"{r.kernel} {r.signature}": r.problems for r in reports if r.problems}
    assert not problems, problems


@pytest.mark.gpu
def test_the_sass_check_catches_a_tensor_core_kernel():
    from cmpchat.devtools.sass_check import disassemble, kernel_cubin

    dispatcher = cuda.jit(tensor_core_control)
    a = cuda.to_device(np.zeros(64, np.int32))
    b = cuda.to_device(np.zeros(32, np.int32))
    out = cuda.device_array(32, np.float32)
    dispatcher[1, 32](a, b, out)  # runs: zero inputs give zero sums
    np.testing.assert_array_equal(out.copy_to_host(), 0)
    sass = disassemble(kernel_cubin(dispatcher, "void(int32[::1], int32[::1], float32[::1])"))
    assert "HMMA" in tensor_core_opcodes(sass)
