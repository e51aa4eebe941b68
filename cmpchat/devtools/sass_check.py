"""SASS check, on a machine with a GPU: the machine code of every registered kernel has no tensor-core opcode.

The PTX check (`ptx_check`, CPU) reads what Numba asked for; this reads what the GPU runs. Each registered
signature is compiled by its dispatcher for the current GPU, the cubin is disassembled with `cuobjdump -sass`
(or `nvdisasm`), and any opcode ending in MMA fails: HMMA, IMMA, BMMA, DMMA and Hopper's HGMMA/IGMMA/QGMMA
(`python -m cmpchat.devtools.sass_check`; exit status 1 on a finding), except in the kernels the PTX check's
allow-list names (`ptx_check.TENSOR_CORE_PROBE_KERNELS`: the tensor-core probe of `cmpchat doctor`). No
sm_70 disassembler is installable (docs/hardware.md), so this runs on the sm_90 test GPU: code generation is per
architecture, but a kernel whose PTX has no `mma` has no reason to gain one in any SASS.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cmpchat.cudart.compile import KernelSpec
from cmpchat.devtools.ptx_check import TENSOR_CORE_PROBE_KERNELS

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_TOOLKIT_BINARIES = (Path("/usr/local/cuda/bin"),)


@dataclass
class SassReport:
    kernel: str
    signature: str
    instructions: int = 0
    tensor_core_opcodes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def sass_opcodes(sass: str) -> list[str]:
    """The opcode of every instruction in a disassembly, without modifiers (`HMMA.16816.F32` → `HMMA`)."""
    return _INSTRUCTION.findall(sass)


def tensor_core_opcodes(sass: str) -> list[str]:
    """Distinct tensor-core opcodes in a disassembly (every SASS opcode ending in MMA is one)."""
    return sorted({opcode for opcode in sass_opcodes(sass) if opcode.endswith("MMA")})


def disassembler() -> list[str]:
    """The command that prints a cubin's SASS: cuobjdump, else nvdisasm, from PATH or the toolkit."""
    for tool, flags in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
        found = shutil.which(tool) or next((str(d / tool) for d in _TOOLKIT_BINARIES if (d / tool).is_file()), None)
        if found:
            return [found, *flags]
    raise FileNotFoundError("neither cuobjdump nor nvdisasm found (CUDA toolkit's bin/)")


def disassemble(cubin: bytes, command: list[str] | None = None) -> str:
    """The SASS text of a cubin."""
    command = command or disassembler()
    # CUDA 13's cuobjdump runs nvdisasm for -sass and looks for it on PATH: put the toolkit's bin there.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(command[0]).parent), os.environ.get("PATH", "")])}
    with tempfile.TemporaryDirectory(prefix="cmpchat-sass-") as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        finished = subprocess.run([*command, str(path)], capture_output=True, text=True, env=env, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"disassembly failed: {(finished.stdout + finished.stderr).strip()[-2000:]}")
    return finished.stdout


def kernel_cubin(dispatcher, signature: str) -> bytes:
    """The cubin the dispatcher launches for this signature on the current GPU (compiled if needed)."""
    cubin = dispatcher.compile(signature).library.get_cubin()
    # numba-cuda hands out a cuda.core ObjectCode on CUDA 13 machines, plain bytes elsewhere.
    code = getattr(cubin, "code", cubin)
    return bytes(code) if not isinstance(code, str) else open(code, "rb").read()


def check_kernel(spec: KernelSpec, signature: str, command: list[str] | None = None) -> SassReport:
    report = SassReport(f"{spec.module}.{spec.name}", signature)
    try:
        sass = disassemble(kernel_cubin(spec.dispatcher, signature), command)
    except Exception as error:  # a kernel that fails to build is a finding for the table, not a crash
        report.problems.append(f"{type(error).__name__}: {error}")
        return report
    report.instructions = len(sass_opcodes(sass))
    report.tensor_core_opcodes = tensor_core_opcodes(sass)
    if report.instructions == 0:
        report.problems.append("no instructions found in the disassembly")
    if report.tensor_core_opcodes and report.kernel not in TENSOR_CORE_PROBE_KERNELS:
        report.problems.append(f"tensor-core opcodes: {', '.join(report.tensor_core_opcodes)}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cmpchat.devtools.sass_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", default=[], help="also import this module (its kernels count)")
    args = parser.parse_args(argv)

    from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels

    imported, failed = import_kernel_modules(args.module)
    for name, error in failed.items():
        print(f"FAIL import {name}:\n{error}\n", file=sys.stderr)
    command = disassembler()
    reports = [check_kernel(spec, signature, command) for spec in registered_kernels() for signature in spec.signatures]
    width = max([len(r.kernel) for r in reports] + [6])
    print(f"modules: {', '.join(imported)}\ndisassembler: {' '.join(command)}\n")
    print(f"{'kernel'.ljust(width)}  instructions  status  signature")
    for report in reports:
        status = "ok" if not report.problems else "FAIL"
        print(f"{report.kernel.ljust(width)}  {report.instructions:12d}  {status:6s}  {report.signature}")
    for report in reports:
        for problem in report.problems:
            print(f"\nFAIL {report.kernel} {report.signature}: {problem}")
    return 1 if failed or any(report.problems for report in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
