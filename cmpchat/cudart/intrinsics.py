"""The GPU primitives Numba lacks, written as inline PTX, each with a pure-Python body for the simulator.

Numba-CUDA has no `dp4a` and the CUDA simulator (CI has no GPU) runs no inline PTX and no warp shuffles.
Every kernel uses these names, so the simulator exercises the same kernel bodies with the fallbacks:

- `dp4a(a, b, c)`: c + dot of the four signed bytes packed in a and in b (int32).
- `shfl_xor_f32(value, lane_mask)` / `shfl_xor_i32`: the value of lane `lane ^ lane_mask`. The fallback
  goes through shared memory and block-wide barriers, so under the simulator every thread of the block
  must call it together (kernels call the reductions below from uniform control flow).
- `warp_sum_f32`, `warp_max_f32`: butterfly reductions; every lane gets the result. `block_sum_f32`: the
  same over a whole block. `sum_in_order`: a strided fp32 sum in a fixed order (unsigned indices).
- `unpack_f16x2(word)`: the two fp16 values packed in a uint32 (low half first) as fp32, exactly.
- `fma_f16x2(a, b, c)`: a × b + c on the two fp16 lanes packed in each uint32, fused, one rounding (HFMA2).
- `fma_f32(a, b, c)`: a × b + c in fp32 with one rounding (FFMA); the simulator's `cuda.fma` rounds twice.
- `load_shared_f32x4(array, index)`, `store_shared_f32x4(array, index, a, b, c, d)`, `store_f32x4(...)`:
  16-byte shared-memory loads/stores and global stores of flat fp32 arrays (Numba emits only scalar ones).
- `load_u32x4(array, index)`: one 16-byte load of array[index:index+4] (index a multiple of 4) through the
  read-only path, for streaming weights; `load_f32x4` the same for float32 arrays (activations).
- `wait_for_prior_grids()`, `allow_dependent_grids()`: programmatic dependent launch on sm_90+ (see below);
  `launched_early_here()`: a constant, whether the code is compiled for a GPU where early-launch kernels are
  launched early (sm_90+), to keep work that only pays while waiting out of sm_70 code;
  `prefetch_l2(array, index)`: ask L2 for the line holding array[index] (no register, nothing waits for it).

No tensor-core instruction appears here or anywhere in the engine (docs/hardware.md, "No tensor cores").
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from numba import cuda, float32, int32, types, uint32, uint64
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)
WARP_SIZE = 32
MAX_BLOCK_THREADS = 1024
EARLY_LAUNCH_CAPABILITY = (9, 0)
"""Compute capability from which grid dependency control (griddepcontrol: early launches) exists."""


def fma_f32_exact(a: float, b: float, c: float) -> np.float32:
    """a × b + c rounded once to fp32, ties to even, in exact arithmetic: the simulator's `fma_f32` and the
    GPU self-test's expected values (Python 3.11/3.12 have no math.fma; no overflow handling)."""
    value = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if value == 0:
        return float32(0.0)
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1  # now 2^exponent <= magnitude < 2^(exponent + 1)
    exponent = max(exponent, -126)  # subnormals share the smallest normal binade's spacing
    scaled = magnitude / Fraction(2) ** (exponent - 23)
    whole = scaled.numerator // scaled.denominator
    rest = scaled - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    return float32((1 if value > 0 else -1) * whole * 2.0 ** (exponent - 23))


if SIMULATOR:

    def _signed_byte(word: int, shift: int) -> int:
        byte = (int(word) >> shift) & 0xFF
        return byte - 256 if byte >= 128 else byte

    @cuda.jit(device=True)
    def dp4a(a, b, c):
        total = int(c)
        for shift in (0, 8, 16, 24):
            total += _signed_byte(a, shift) * _signed_byte(b, shift)
        return int32(total)

    @cuda.jit(device=True)
    def _thread_rank():
        return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)

    @cuda.jit(device=True)
    def shfl_xor_f32(value, lane_mask):
        exchange = cuda.shared.array(MAX_BLOCK_THREADS, types.float32)
        rank = _thread_rank()
        exchange[rank] = value
        cuda.syncthreads()
        partner = exchange[rank ^ lane_mask]
        cuda.syncthreads()
        return partner

    @cuda.jit(device=True)
    def shfl_xor_i32(value, lane_mask):
        exchange = cuda.shared.array(MAX_BLOCK_THREADS, types.int32)
        rank = _thread_rank()
        exchange[rank] = value
        cuda.syncthreads()
        partner = exchange[rank ^ lane_mask]
        cuda.syncthreads()
        return partner

    @cuda.jit(device=True)
    def load_u32x4(array, index):
        return array[index], array[index + 1], array[index + 2], array[index + 3]

    @cuda.jit(device=True)
    def load_f32x4(array, index):
        return array[index], array[index + 1], array[index + 2], array[index + 3]

    @cuda.jit(device=True)
    def unpack_f16x2(word):
        halves = np.array([word], dtype=np.uint32).view(np.float16)
        return float32(halves[0]), float32(halves[1])

    @cuda.jit(device=True)
    def fma_f16x2(a, b, c):
        # float64 holds each fp16 product exactly; one rounding to fp16 then matches the hardware's fused
        # rounding except in rare double-rounding ties of operands many binades apart.
        a_half, b_half, c_half = (np.array([w], dtype=np.uint32).view(np.float16).astype(np.float64) for w in (a, b, c))
        return uint32((a_half * b_half + c_half).astype(np.float16).view(np.uint32)[0])

    @cuda.jit(device=True)
    def fma_f32(a, b, c):
        return fma_f32_exact(a, b, c)

else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _three_operand(ptx: str, value_type: types.Type, name: str) -> object:
        """An intrinsic for the PTX instruction `ptx d, a, b, c` on 32-bit registers."""

        def instruction(typingctx, a, b, c):
            if not all(isinstance(operand, types.Integer) for operand in (a, b, c)):
                return None
            signature = value_type(value_type, value_type, value_type)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), f"{ptx} $0, $1, $2, $3;", "=r,r,r,r")
                return builder.call(asm, args)

            return signature, codegen

        instruction.__name__ = instruction.__qualname__ = name
        return intrinsic(instruction)

    dp4a = _three_operand("dp4a.s32.s32", int32, "dp4a")
    fma_f16x2 = _three_operand("fma.rn.f16x2", uint32, "fma_f16x2")

    _FULL_MASK = 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def shfl_xor_f32(value, lane_mask):
        return cuda.shfl_xor_sync(_FULL_MASK, value, lane_mask)

    @cuda.jit(device=True, inline=True)
    def fma_f32(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True, inline=True)
    def shfl_xor_i32(value, lane_mask):
        return cuda.shfl_xor_sync(_FULL_MASK, value, lane_mask)

    def _load_x4(element: types.Type, ptx_type: str, constraint: str) -> object:
        """An intrinsic doing one 16-byte read-only load of array[index:index+4] of `element` values."""

        def load_x4(typingctx, array, index):
            if not (isinstance(array, types.Array) and array.dtype == element and isinstance(index, types.Integer)):
                return None
            signature = types.UniTuple(element, 4)(array, index)

            def codegen(context, builder, sig, args):
                array_value, index_value = args
                array_struct = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=array_value)
                pointer = builder.gep(array_struct.data, [index_value])
                lane_type = ir.IntType(32) if element == uint32 else ir.FloatType()
                struct = ir.LiteralStructType([lane_type] * 4)
                asm = ir.InlineAsm(
                    ir.FunctionType(struct, [pointer.type]),
                    f"ld.global.nc.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                    f"={constraint},={constraint},={constraint},={constraint},l",
                )
                loaded = builder.call(asm, [pointer])
                values = [builder.extract_value(loaded, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, values)

            return signature, codegen

        load_x4.__name__ = load_x4.__qualname__ = f"load_{ptx_type}x4"
        return intrinsic(load_x4)

    load_u32x4 = _load_x4(uint32, "u32", "r")
    load_f32x4 = _load_x4(float32, "f32", "f")

    @intrinsic
    def unpack_f16x2(typingctx, word):
        if not isinstance(word, types.Integer):
            return None
        signature = types.UniTuple(float32, 2)(uint32)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            pair = ir.LiteralStructType([f32, f32])
            asm = ir.InlineAsm(
                ir.FunctionType(pair, [ir.IntType(32)]),
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                "=f,=f,r",
            )
            unpacked = builder.call(asm, args)
            values = [builder.extract_value(unpacked, i) for i in range(2)]
            return context.make_tuple(builder, sig.return_type, values)

        return signature, codegen


@cuda.jit(device=True, inline=True)
def warp_sum_f32(value):
    offset = WARP_SIZE // 2
    while offset > 0:
        value += shfl_xor_f32(value, offset)
        offset //= 2
    return value


MAX_WARPS = MAX_BLOCK_THREADS // WARP_SIZE


@cuda.jit(device=True, inline=True)
def sum_in_order(values, first, stride, count):
    """values[first] + values[first + stride] + ... (`count` terms: uint32; `stride`: uint64), in that order.

    An unsigned while loop: Numba's signed range and indexing cost ~16 instructions an iteration (64-bit
    trip-count bookkeeping, negative-index fix-ups) against 3, in loops every thread of a block runs."""
    total = float32(0.0)
    index = uint64(first)
    i = uint32(0)
    while i < count:
        total += values[index]
        index += stride
        i += uint32(1)
    return total


@cuda.jit(device=True, inline=True)
def block_sum_f32(value):
    """Sum over the whole block (1-D or 2-D, a multiple of 32 threads), the same deterministic total in
    every thread: each warp's butterfly sum, then the warps in order. Every thread must call it together;
    it may be called again right away (its shared slots are free again when it returns)."""
    warp_totals = cuda.shared.array(MAX_WARPS, float32)
    total = warp_sum_f32(value)
    thread = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    if thread % WARP_SIZE == 0:
        warp_totals[thread // WARP_SIZE] = total
    cuda.syncthreads()
    result = sum_in_order(warp_totals, 0, uint64(1), uint32(cuda.blockDim.x * cuda.blockDim.y // WARP_SIZE))
    cuda.syncthreads()
    return result


@cuda.jit(device=True, inline=True)
def warp_max_f32(value):
    offset = WARP_SIZE // 2
    while offset > 0:
        value = max(value, shfl_xor_f32(value, offset))
        offset //= 2
    return value


@cuda.jit(device=True, inline=True)
def warp_sum_i32(value):
    offset = WARP_SIZE // 2
    while offset > 0:
        value += shfl_xor_i32(value, offset)
        offset //= 2
    return value


# -- 16-byte shared-memory and global accesses -------------------------------------------------------
# Numba emits scalar shared loads only (and aligns shared arrays to 4 bytes unless asked): these give the
# LDS.128 / STS.128 / STG.128 that register-tiled kernels are built on. Flat fp32 arrays, index a multiple of 4,
# the shared arrays declared with alignment 16.

if SIMULATOR:

    @cuda.jit(device=True)
    def load_shared_f32x4(array, index):
        return array[index], array[index + 1], array[index + 2], array[index + 3]

    @cuda.jit(device=True)
    def store_shared_f32x4(array, index, a, b, c, d):
        array[index] = a
        array[index + 1] = b
        array[index + 2] = c
        array[index + 3] = d

    store_f32x4 = store_shared_f32x4  # one memory for the simulator

    @cuda.jit(device=True)
    def load_global_f32x4(array, index):
        return array[index], array[index + 1], array[index + 2], array[index + 3]

else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _global_address(context, builder, array_type, index_type, array_value, index_value):
        array_struct = cgutils.create_struct_proxy(array_type)(context, builder, value=array_value)
        return builder.gep(array_struct.data, [index_value])

    def _shared_address(context, builder, array_type, index_type, array_value, index_value):
        """array[index]'s address in the shared window, in 32 bits: the base converted from generic once per
        array, the index arithmetic narrowed to 32 bits (64-bit generic addresses cost the register-tiled loops
        two or three integer instructions per 16-byte load)."""
        array_struct = cgutils.create_struct_proxy(array_type)(context, builder, value=array_value)
        i32 = ir.IntType(32)
        shared = builder.addrspacecast(array_struct.data, ir.PointerType(ir.FloatType(), addrspace=3))
        base = builder.ptrtoint(shared, i32)  # shared-window addresses fit 32 bits
        index = context.cast(builder, index_value, index_type, types.int32)
        return builder.add(base, builder.shl(index, ir.Constant(i32, 2)))

    def _load_f32x4(ptx: str, name: str, address_of, constraint: str, volatile: bool) -> object:
        def load_x4(typingctx, array, index):
            if not (isinstance(array, types.Array) and array.dtype == float32 and isinstance(index, types.Integer)):
                return None
            signature = types.UniTuple(float32, 4)(array, index)

            def codegen(context, builder, sig, args):
                address = address_of(context, builder, *sig.args, *args)
                f32 = ir.FloatType()
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [address.type]), ptx,
                                   f"=f,=f,=f,=f,{constraint},~{{memory}}", side_effect=volatile)  # fmt: skip
                loaded = builder.call(asm, [address])
                values = [builder.extract_value(loaded, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, values)

            return signature, codegen

        load_x4.__name__ = load_x4.__qualname__ = name
        return intrinsic(load_x4)

    # Volatile and clobbering memory: without it NVVM takes the asm for a pure function of the address and
    # hoists/CSEs it across cuda.syncthreads() (gdn_chunk_state's d_shared reads were hoisted out of the chunk
    # loop: garbage on the GPU, invisible to the simulator).
    load_shared_f32x4 = _load_f32x4(
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "load_shared_f32x4", _shared_address, "r", volatile=True
    )
    # Through the coherent path, for data the kernel overwrites later (after reading it): the read-only
    # `load_f32x4` needs memory no thread writes during the kernel. Clobbering memory keeps it in order with this
    # thread's stores, as any load of written memory.
    load_global_f32x4 = _load_f32x4(
        "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "load_global_f32x4", _global_address, "l", volatile=False
    )

    def _store_x4(ptx: str, name: str, address_of, constraint: str) -> object:
        def store_x4(typingctx, array, index, a, b, c, d):
            if not (isinstance(array, types.Array) and array.dtype == float32 and isinstance(index, types.Integer)):
                return None
            signature = types.none(array, index, float32, float32, float32, float32)

            def codegen(context, builder, sig, args):
                address = address_of(context, builder, sig.args[0], sig.args[1], args[0], args[1])
                f32 = ir.FloatType()
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [address.type, f32, f32, f32, f32]), ptx,
                                   f"{constraint},f,f,f,f,~{{memory}}", side_effect=True)  # fmt: skip
                builder.call(asm, [address, *args[2:]])
                return context.get_dummy_value()

            return signature, codegen

        store_x4.__name__ = store_x4.__qualname__ = name
        return intrinsic(store_x4)

    store_shared_f32x4 = _store_x4(
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "store_shared_f32x4", _shared_address, "r"
    )
    store_f32x4 = _store_x4("st.global.v4.f32 [$0], {$1, $2, $3, $4};", "store_f32x4", _global_address, "l")


# -- Grid dependency control (programmatic dependent launch, sm_90+) -------------------------------------
# A kernel launched "early" (`compile.kernel(early_launch=True)`, `raw_launch`) may start while the launch
# before it still runs: it must call `wait_for_prior_grids()` before it reads memory an earlier launch writes
# and before it writes anything, and may do independent work first (address arithmetic, prefetching weights).
# `allow_dependent_grids()` lets the launch after it start early in turn, once every block has called it.
# Both compile to nothing below sm_90 (NVVM's __CUDA_ARCH reflection, folded before PTX is emitted), where
# every launch waits for its predecessor to finish as usual; on sm_90 they are no-ops for ordinary launches.

if SIMULATOR:

    @cuda.jit(device=True)
    def wait_for_prior_grids():
        pass

    @cuda.jit(device=True)
    def allow_dependent_grids():
        pass

    @cuda.jit(device=True)
    def prefetch_l2(array, index):
        pass

    @cuda.jit(device=True)
    def launched_early_here():
        return True  # the simulator takes the sm_90 path, so CI runs its index arithmetic

else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    GRID_DEPENDENCY_ARCH = 100 * EARLY_LAUNCH_CAPABILITY[0] + 10 * EARLY_LAUNCH_CAPABILITY[1]
    """EARLY_LAUNCH_CAPABILITY as __CUDA_ARCH spells it (900)."""

    def _arch_at_least(builder: ir.IRBuilder, arch: int) -> ir.Value:
        """An i1: whether the code is being compiled for __CUDA_ARCH >= arch (a constant once NVVM reflects)."""
        module = builder.module
        i8, i32 = ir.IntType(8), ir.IntType(32)
        name = "__cmpchat_cuda_arch_key"
        key = module.globals.get(name)
        if key is None:
            text = bytearray(b"__CUDA_ARCH\x00")
            key = ir.GlobalVariable(module, ir.ArrayType(i8, len(text)), name=name)
            key.global_constant = True
            key.linkage = "private"
            key.initializer = ir.Constant(key.type.pointee, text)
        reflect = cgutils.get_or_insert_function(module, ir.FunctionType(i32, [i8.as_pointer()]), "__nvvm_reflect")
        value = builder.call(reflect, [builder.bitcast(key, i8.as_pointer())])
        return builder.icmp_signed(">=", value, ir.Constant(i32, arch))

    def _grid_dependency_control(action: str) -> object:
        """An intrinsic emitting `griddepcontrol.<action>` on sm_90+ and nothing elsewhere. Volatile and clobbering
        memory, so NVVM keeps ordinary loads and stores on their side of it; the inline-asm loads above carry no
        clobber and might in principle move, so `ptx_check` checks the order in every early kernel's PTX."""

        def control(typingctx):
            def codegen(context, builder, sig, args):
                with builder.if_then(_arch_at_least(builder, GRID_DEPENDENCY_ARCH)):
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"griddepcontrol.{action};",
                                       "~{memory}", side_effect=True)  # fmt: skip
                    builder.call(asm, [])
                return context.get_dummy_value()

            return types.none(), codegen

        control.__name__ = control.__qualname__ = f"griddepcontrol_{action}"
        return intrinsic(control)

    wait_for_prior_grids = _grid_dependency_control("wait")
    allow_dependent_grids = _grid_dependency_control("launch_dependents")

    @intrinsic
    def launched_early_here(typingctx):
        def codegen(context, builder, sig, args):
            return _arch_at_least(builder, GRID_DEPENDENCY_ARCH)

        return types.boolean(), codegen

    @intrinsic
    def prefetch_l2(typingctx, array, index):
        if not (isinstance(array, types.Array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            pointer = _global_address(context, builder, *sig.args, *args)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [pointer.type]), "prefetch.global.L2 [$0];", "l",
                               side_effect=True)  # fmt: skip
            builder.call(asm, [pointer])
            return context.get_dummy_value()

        return types.none(array, index), codegen
