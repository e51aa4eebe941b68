"""The PTX check: every registered kernel compiles for the CMP's compute_70 without tensor-core instructions,
with the raw launcher's parameter layout, and without spilling registers. CPU only: the check itself runs in
a subprocess without the simulator (which cannot compile PTX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmpchat.cudart.discovery import SELFTEST_MODULE, kernel_module_names
from cmpchat.cudart.kernel_args import Param
from cmpchat.devtools.ptx_check import (
    accesses_before_grid_wait,
    entry_parameters,
    find_tensor_core_instructions,
    format_table,
    layout_mismatch,
    parse_ptxas_verbose,
)

REPO = Path(__file__).resolve().parents[2]

KQUANT_NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
SPILL_ALLOWANCES: dict[str, int] = {
    # A prompt chunk's rows in turn with the 16 state values held in registers across them (64 at 1024
    # threads): 7 words go to L1-resident local memory, where a round trip of the state through L2 per row
    # spills more (measured 248 bytes). The decode kernel, the same code at one row, does not spill.
    "cmpchat.kernels.gated_deltanet.gdn_recurrent_prompt": 56,
    # The state pass holds the next W/K tile (64 values), its 4x4 state tile and Delta's operands in registers;
    # walking the tile rows with one address increment per load (instead of a division per load, 2.4x faster
    # on the H200) leaves sm_70 one 8-byte value in local memory, none on sm_90.
    "cmpchat.kernels.gated_deltanet_chunked.state.gdn_chunk_state": 16,
    # The prefetching GEMMs at 128 registers: sm_90's default (no spill there); sm_70 runs the same code at
    # 168 registers (`gemm.SM70_TILING`), which does not spill. The 4/5/6-bit ones hold a stage's raw blocks and
    # their scales in the same registers (measured: 48 to 324 bytes).
    "cmpchat.kernels.gemm.gemm_q8_64_64k2p": 304,
    **{f"cmpchat.kernels.gemm.gemm_{t}_64_64k2p": 352 for t in KQUANT_NAMES},
    # The 4/5/6-bit fused one-token GEMVs at the 80 registers of 768 threads an SM: each step's high words, second
    # scale and minimum beside the loads in flight leave 8-76 bytes in L1-resident local memory on sm_70 (none in
    # the 2-group variants, at 88-128 registers); what that costs on a CMP is not measured.
    **{f"cmpchat.kernels.gemv_fused.gemv_{t}_fused_s{s}g{g}": 80 for t in KQUANT_NAMES for s in (2, 4) for g in (1, 3)},
}
"""Kernels allowed to spill, with the most spill bytes (stores + loads) each may have, e.g.
`{"cmpchat.kernels.NAME.KERNEL": 8}` with a comment saying why the spill is worth keeping."""

PTX = """
.version 8.8
.target sm_70
.address_size 64
	// .globl	_Z6kernelP
.visible .entry _Z6kernelP(
	.param .u64 _Z6kernelP_param_0,
	.param .u32 _Z6kernelP_param_1,
	.param .f32 _Z6kernelP_param_2,
	.param .u16 _Z6kernelP_param_3,
	.param .align 8 .b8 _Z6kernelP_param_4[16]
)
{
	.reg .b32 	%r<4>;
mma_loop:
	// begin inline asm
	dp4a.s32.s32 %r1, %r2, %r3, %r1;
	// end inline asm
	// a comment about mma.sync is not an instruction
	ret;
}
"""


def test_tensor_core_instructions_are_found_and_only_instructions():
    assert find_tensor_core_instructions(PTX) == []
    assert find_tensor_core_instructions(
        PTX.replace("ret;", "@%p1 mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {};")
    ) == ["mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32"]
    for instruction in (
        "wmma.load.a.sync.aligned.row.m16n16k16.f16",
        "wgmma.mma_async.sync.aligned",
        "tcgen05.mma.cta",
    ):
        assert find_tensor_core_instructions(PTX.replace("ret;", f"{{ {instruction} x; }}")) == [instruction]


def test_entry_parameters_give_kind_and_size():
    assert entry_parameters(PTX) == [("u", 8), ("u", 4), ("f", 4), ("u", 2), ("b", 16)]


def test_layout_mismatches_are_named():
    params = [Param("arg0", "q", None), Param("arg1", "i", None), Param("arg2", "f", None)]
    assert layout_mismatch(params, [("u", 8), ("u", 4), ("f", 4)]) is None
    wrong_kind = layout_mismatch(params, [("u", 8), ("u", 4), ("u", 4)])
    assert wrong_kind is not None and "parameter 2 (arg2)" in wrong_kind
    too_few = layout_mismatch(params, [("u", 8), ("u", 4)])
    assert too_few is not None and "packs 3 parameters" in too_few


EARLY_PTX = """
	ld.param.u64 	%rd1, [kernel_param_0];
	ld.shared.u32 	%r1, [%r2];
	prefetch.global.L2 [%rd3];
	// ld.global.f32 in a comment is no load
	griddepcontrol.launch_dependents;
	griddepcontrol.wait;
	ld.global.nc.v4.f32 	{%f1, %f2, %f3, %f4}, [%rd4];
	st.global.f32 	[%rd5], %f1;
"""


def test_memory_other_launches_write_is_not_touched_before_the_grid_wait():
    assert accesses_before_grid_wait(EARLY_PTX) == []
    assert accesses_before_grid_wait(EARLY_PTX.replace("griddepcontrol.wait;", "")) is None
    wait = "\tgriddepcontrol.wait;"
    for access in ("ld.global.nc.v4.u32", "@%p1 st.global.f32", "ld.f32", "atom.global.add.f32", "red.add.u32"):
        moved = EARLY_PTX.replace(wait, f"\t{access} \t%f9, [%rd9];\n{wait}")
        assert accesses_before_grid_wait(moved) == [access.removeprefix("@%p1 ")], access


PTXAS_OUTPUT = """ptxas info    : 8 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function '_Z6kernelP' for 'sm_70'
ptxas info    : Function properties for _Z6kernelP
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 10368 bytes smem, 547 bytes cmem[0]
ptxas info    : Function properties for _Z6helperf
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compile time = 13.021 ms
"""


def test_ptxas_resource_usage_is_parsed_and_spills_summed_over_called_functions():
    usage = parse_ptxas_verbose(PTXAS_OUTPUT)["_Z6kernelP"]
    assert (usage.registers, usage.shared_bytes) == (64, 10368)
    assert (usage.stack_bytes, usage.spill_stores, usage.spill_loads) == (24, 16, 12)


@pytest.fixture(scope="module")
def ptx_check_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    """The check's output and JSON report, with the kernel modules present when it started."""
    report = tmp_path_factory.mktemp("ptx") / "ptx_check.json"
    modules = kernel_module_names()
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    finished = subprocess.run(
        [sys.executable, "-m", "cmpchat.devtools.ptx_check", "--json", str(report)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    payload = json.loads(report.read_text()) if report.exists() else {}
    payload["expected_modules"] = modules
    return finished, payload


def test_every_kernel_compiles_for_compute_70_without_tensor_cores(ptx_check_run):
    finished, payload = ptx_check_run
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert not payload["failed_modules"]
    assert all(not kernel["problems"] for kernel in payload["kernels"])


def test_every_kernel_module_and_the_selftest_kernels_are_checked(ptx_check_run):
    _, payload = ptx_check_run
    assert set(payload["modules"]) >= {*payload["expected_modules"], SELFTEST_MODULE}
    checked = {kernel["kernel"] for kernel in payload["kernels"]}
    assert {
        f"{SELFTEST_MODULE}.dp4a_words",
        f"{SELFTEST_MODULE}.warp_reductions",
        f"{SELFTEST_MODULE}.load_words",
    } <= checked


def test_no_kernel_spills_registers_beyond_its_allowance(ptx_check_run):
    _, payload = ptx_check_run
    spilling = {}
    for kernel in payload["kernels"]:
        usage = kernel["usage"]
        spilled = usage["spill_stores"] + usage["spill_loads"]
        if spilled > SPILL_ALLOWANCES.get(kernel["kernel"], 0):
            spilling[f"{kernel['kernel']} {kernel['signature']}"] = spilled
    assert not spilling, f"register spills (bytes stored + loaded): {spilling}"


def test_the_table_names_each_kernel_with_its_numbers(ptx_check_run):
    finished, payload = ptx_check_run
    for kernel in payload["kernels"]:
        assert kernel["kernel"] in finished.stdout
    assert "regs" in format_table([])
