"""The PTX and SASS checks exempt exactly the doctor's tensor-core probe, by name: the probe really issues
`wmma` (so the exemption is needed) and compiles for sm_70, while the same kernel under any other name fails
both checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmpchat.cudart.compile import KernelSpec
from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels
from cmpchat.devtools import sass_check
from cmpchat.devtools.ptx_check import TENSOR_CORE_PROBE_KERNELS

REPO = Path(__file__).resolve().parents[2]
PROBE_MODULE = "cmpchat.kernels.tensor_core_probe"
PROBE_KERNEL = f"{PROBE_MODULE}.mma_chains"
WMMA = "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32"


def probe_spec() -> KernelSpec:
    import_kernel_modules()
    (spec,) = [spec for spec in registered_kernels() if spec.module == PROBE_MODULE]
    return spec


def renamed(spec: KernelSpec) -> KernelSpec:
    """The same kernel under a name the allow-list does not hold."""
    return KernelSpec("mma_chains_elsewhere", spec.module, spec.signatures, spec.dispatcher)


def test_the_allow_list_names_exactly_the_probe_kernel():
    spec = probe_spec()
    assert TENSOR_CORE_PROBE_KERNELS == {f"{spec.module}.{spec.name}"} == {PROBE_KERNEL}


# Run outside the simulator (it cannot compile PTX): the real check on the probe and on a renamed copy.
PTX_CHECK_SCRIPT = """
import json
from tests.kernels.test_tensor_core_exemption import probe_spec, renamed
from cmpchat.devtools.ptx_check import check_kernel, compile_ptx, find_ptxas, find_tensor_core_instructions

spec = probe_spec()
(signature,) = spec.signatures
ptxas = find_ptxas()
exempt, other = check_kernel(spec, signature, ptxas), check_kernel(renamed(spec), signature, ptxas)
print(json.dumps({
    "instructions": sorted(set(find_tensor_core_instructions(compile_ptx(spec, signature)))),
    "exempt": [exempt.kernel, exempt.problems, exempt.usage is not None, exempt.spills],
    "other": [other.kernel, other.problems],
}))
"""


def test_the_ptx_check_exempts_the_probe_and_fails_it_under_another_name():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    finished = subprocess.run(
        [sys.executable, "-c", PTX_CHECK_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert result["instructions"] == [WMMA]
    assert result["exempt"] == [PROBE_KERNEL, [], True, 0]  # no problem; assembled for sm_70, without spills
    kernel, problems = result["other"]
    assert kernel == f"{PROBE_MODULE}.mma_chains_elsewhere"
    assert problems == [f"tensor-core instructions: {WMMA}"]


SASS_WITH_HMMA = """
        /*0000*/                   HMMA.884.F32.F32.STEP0 R8, R4.reuse.ROW, R6.reuse.COL, R8 ;
        /*0010*/                   EXIT ;
"""


def test_the_sass_check_exempts_the_probe_and_fails_it_under_another_name(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sass_check, "kernel_cubin", lambda dispatcher, signature: b"")
    monkeypatch.setattr(sass_check, "disassemble", lambda cubin, command=None: SASS_WITH_HMMA)
    spec = probe_spec()
    (signature,) = spec.signatures
    exempt = sass_check.check_kernel(spec, signature, ["disassembler"])
    assert (exempt.tensor_core_opcodes, exempt.problems) == (["HMMA"], [])
    other = sass_check.check_kernel(renamed(spec), signature, ["disassembler"])
    assert other.problems == ["tensor-core opcodes: HMMA"]
