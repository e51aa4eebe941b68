"""`python -m cmpchat.devtools.ptx_check`: every registered kernel, compiled for the CMP's sm_70, on a CPU.

For each kernel signature in `cmpchat.cudart.compile.KERNELS` (after importing every module under
`cmpchat.kernels`, see `discovery`), this:

1. compiles it to PTX for compute capability 7.0 with the CUDA 12 NVVM (`numba.cuda.compile_ptx`; CUDA 13
   refuses cc < 7.5, so run it where `numba-cuda[cu12]` is installed, without the simulator);
2. fails on any tensor-core instruction (`mma`, `wmma`, `wgmma`, `tcgen05.mma`): the CMP throttles them 64×
   (only the kernels named in `TENSOR_CORE_PROBE_KERNELS` are exempt);
3. checks the kernel's PTX parameter list against the raw launcher's packing (`kernel_args`);
4. assembles it with the `ptxas` of the `nvidia-cuda-nvcc-cu12` wheel (`-arch=sm_70 -v`) and prints
   registers, spills, stack and static shared memory per kernel;
5. for a kernel defined with `early_launch`, compiles it for compute capability 9.0 too and fails unless its
   PTX waits for prior grids (`griddepcontrol.wait`) before any load or store outside shared, local, param
   and constant memory: such a launch may start while the one before it still writes.

Exit status 1 if any kernel module fails to import or any kernel fails a step (2 with `--fail-on-spills`
also for spills). `--json` writes the table for tests and later comparisons.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from cmpchat.cudart.compile import KernelSpec
from cmpchat.cudart.intrinsics import EARLY_LAUNCH_CAPABILITY
from cmpchat.cudart.kernel_args import Param, kernel_params

CMP_COMPUTE_CAPABILITY = (7, 0)

TENSOR_CORE_PROBE_KERNELS = frozenset({"cmpchat.kernels.tensor_core_probe.mma_chains"})
"""The only kernels allowed tensor-core instructions, by qualified name: `cmpchat doctor --tensor-cores`
measures how hard a card throttles them, and no engine path runs it. The checkers name the exemption, so
no kernel can grant it to itself (the SASS check uses the same list)."""

_TENSOR_CORE_INSTRUCTION = re.compile(
    r"^\s*\{?\s*(?:@!?%\w+\s+)?((?:wgmma|wmma|mma|tcgen05\.mma)\b[\w.:]*)", re.MULTILINE
)
_MEMORY_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:ld|st|atom|red)(?:\.[\w]+)*)", re.MULTILINE)
_PRIVATE_SPACES = {"shared", "local", "param", "const"}
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\((.*?)\)", re.DOTALL)
_ENTRY_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.([busf])(\d+)\s+[\w$]+(?:\[(\d+)\])?")
_PTXAS_FUNCTION = re.compile(r"Function properties for ([\w$]+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([\w$]+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SHARED = re.compile(r"(\d+) bytes smem")


@dataclass
class ResourceUsage:
    """What ptxas reports for one entry function (spills and stack summed over the functions it calls)."""

    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass
class KernelReport:
    kernel: str
    signature: str
    usage: ResourceUsage | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def spills(self) -> int:
        return 0 if self.usage is None else self.usage.spill_stores + self.usage.spill_loads


def find_tensor_core_instructions(ptx: str) -> list[str]:
    """The tensor-core instructions in PTX text (instructions only: names that merely contain 'mma' pass)."""
    return [match.group(1) for match in _TENSOR_CORE_INSTRUCTION.finditer(_strip_comments(ptx))]


def accesses_before_grid_wait(ptx: str) -> list[str] | None:
    """The loads and stores of memory other launches may touch (global or generic addresses) that come before
    the first `griddepcontrol.wait` in the PTX, or None when there is no wait at all."""
    text = _strip_comments(ptx)
    wait = text.find("griddepcontrol.wait")
    if wait < 0:
        return None
    found = []
    for match in _MEMORY_ACCESS.finditer(text[:wait]):
        spaces = set(match.group(1).split(".")[1:])
        if not spaces & _PRIVATE_SPACES:
            found.append(match.group(1))
    return found


def entry_parameters(ptx: str) -> list[tuple[str, int]]:
    """The entry's parameters as (kind, bytes): kind 'f' for floating point, 'b', 'u' or 's' otherwise."""
    match = _ENTRY.search(_strip_comments(ptx))
    if match is None:
        raise ValueError("no .entry in the PTX")
    params = []
    for kind, bits, count in _ENTRY_PARAM.findall(match.group(2)):
        params.append((kind, int(bits) // 8 * (int(count) if count else 1)))
    return params


def layout_mismatch(params: list[Param], ptx_params: list[tuple[str, int]]) -> str | None:
    """Why the raw launcher's packing disagrees with the PTX entry, or None when they agree."""
    if len(params) != len(ptx_params):
        return f"raw launcher packs {len(params)} parameters, the PTX entry takes {len(ptx_params)}"
    for index, (param, (kind, size)) in enumerate(zip(params, ptx_params)):
        if param.size != size or param.is_float != (kind == "f"):
            return f"parameter {index} ({param.name}): packed as {param.format!r}, PTX has .{kind}{size * 8}"
    return None


def parse_ptxas_verbose(output: str) -> dict[str, ResourceUsage]:
    """Resource usage per entry function from `ptxas -v` output."""
    frames: dict[str, tuple[int, int, int]] = {}
    entries: dict[str, ResourceUsage] = {}
    current_function = current_entry = None
    for line in output.splitlines():
        if match := _PTXAS_FUNCTION.search(line):
            current_function = match.group(1)
        elif (match := _PTXAS_FRAME.search(line)) and current_function is not None:
            frames[current_function] = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        elif match := _PTXAS_ENTRY.search(line):
            current_entry = match.group(1)
            entries[current_entry] = ResourceUsage()
        if (match := _PTXAS_USED.search(line)) and current_entry is not None:
            entries[current_entry].registers = int(match.group(1))
            if shared := _PTXAS_SHARED.search(line):
                entries[current_entry].shared_bytes = int(shared.group(1))
    # Whole-program compilation: every non-entry function belongs to the (single) entry of its PTX.
    for usage in entries.values():
        for stack, stores, loads in frames.values():
            usage.stack_bytes += stack
            usage.spill_stores += stores
            usage.spill_loads += loads
    return entries


def find_ptxas() -> Path:
    """The ptxas of the `nvidia-cuda-nvcc-cu12` wheel (CUDA 12: the last that assembles sm_70)."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("no ptxas from the nvidia-cuda-nvcc-cu12 wheel; install numba-cuda[cu12]")


def compile_ptx(spec: KernelSpec, signature: str, cc: tuple[int, int] = CMP_COMPUTE_CAPABILITY) -> str:
    """PTX for compute capability `cc` (the CMP's by default), with the options the kernel's dispatcher
    compiles with."""
    from numba import cuda

    options = spec.dispatcher.targetoptions
    with _device_functions_target(cc):
        ptx, _ = cuda.compile_ptx(
            spec.dispatcher.py_func,
            signature,
            debug=options.get("debug"),
            lineinfo=options.get("lineinfo", False),
            fastmath=options.get("fastmath", False),
            opt=options.get("opt", True),
            launch_bounds=options.get("launch_bounds"),
            cc=cc,
        )
    return ptx


@contextmanager
def _device_functions_target(cc: tuple[int, int]) -> Iterator[None]:
    """Let non-inline device functions compile without a GPU, for compute capability `cc`.

    `compile_ptx` takes `cc` for the kernel, but a `@cuda.jit(device=True)` function it calls is compiled
    by its own dispatcher, which asks the current device for its compute capability (numba-cuda 0.30,
    `CUDADispatcher.compile_device`), and there is none here. Answer `cc` meanwhile.
    """
    import numba.cuda.dispatcher as numba_dispatcher

    real = numba_dispatcher.get_current_device
    numba_dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        numba_dispatcher.get_current_device = real


def assemble(ptx: str, ptxas: Path, max_registers: int | None = None) -> ResourceUsage:
    """Run `ptxas -arch=sm_70 -v` on the PTX and return the entry's resource usage."""
    with tempfile.TemporaryDirectory(prefix="cmpchat-ptx-") as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [str(ptxas), "-arch=sm_70", "-v", str(source), "-o", str(Path(folder) / "kernel.cubin")]
        if max_registers:
            command.insert(1, f"-maxrregcount={max_registers}")
        finished = subprocess.run(command, capture_output=True, text=True, check=False)
    output = finished.stdout + finished.stderr
    if finished.returncode != 0:
        raise RuntimeError(f"ptxas failed: {output.strip()[-2000:]}")
    entries = parse_ptxas_verbose(output)
    if len(entries) != 1:
        raise RuntimeError(f"ptxas reported {len(entries)} entry functions, expected 1:\n{output}")
    return next(iter(entries.values()))


def check_kernel(spec: KernelSpec, signature: str, ptxas: Path, ptx_dir: Path | None = None) -> KernelReport:
    """All five checks for one kernel signature; problems are collected, not raised."""
    from numba.cuda.core import sigutils

    report = KernelReport(f"{spec.module}.{spec.name}", signature)
    try:
        ptx = compile_ptx(spec, signature)
    except Exception as error:  # a kernel that does not compile is a finding, not a crash
        report.problems.append(f"compile_ptx failed: {type(error).__name__}: {error}")
        return report
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
        safe_signature = re.sub(r"[^\w.-]+", "_", signature)
        (ptx_dir / f"{report.kernel}.{safe_signature}.ptx").write_text(ptx)
    if (found := find_tensor_core_instructions(ptx)) and report.kernel not in TENSOR_CORE_PROBE_KERNELS:
        report.problems.append(f"tensor-core instructions: {', '.join(sorted(set(found)))}")
    argtypes, _ = sigutils.normalize_signature(signature)
    try:
        mismatch = layout_mismatch(kernel_params(argtypes), entry_parameters(ptx))
    except (TypeError, ValueError) as error:
        mismatch = str(error)
    if mismatch:
        report.problems.append(f"raw-launch layout: {mismatch}")
    try:
        report.usage = assemble(ptx, ptxas, spec.dispatcher.targetoptions.get("max_registers"))
    except RuntimeError as error:
        report.problems.append(str(error))
    if spec.early_launch:
        report.problems += early_launch_problems(spec, signature)
    return report


def early_launch_problems(spec: KernelSpec, signature: str) -> list[str]:
    """Why the kernel may not be launched early, judged from its compute_90 PTX (empty when it may)."""
    try:
        ptx = compile_ptx(spec, signature, EARLY_LAUNCH_CAPABILITY)
    except Exception as error:
        return [f"compile_ptx for compute_90 failed: {type(error).__name__}: {error}"]
    early = accesses_before_grid_wait(ptx)
    if early is None:
        return ["defined with early_launch but its compute_90 PTX has no griddepcontrol.wait"]
    if early:
        return [f"early launch: {', '.join(sorted(set(early)))} before griddepcontrol.wait"]
    return []


def check_all(
    jobs: list[tuple[KernelSpec, str]], ptxas: Path, ptx_dir: Path | None, processes: int
) -> list[KernelReport]:
    """`check_kernel` for every (kernel, signature), in forked worker processes when there are several.

    Compilation is CPU-bound Python and NVVM, so processes rather than threads; forked workers inherit the
    imported registry and take job numbers (dispatchers do not pickle). Reports keep the jobs' order.
    """
    if processes <= 1 or len(jobs) <= 1:
        return [check_kernel(spec, signature, ptxas, ptx_dir) for spec, signature in jobs]
    global _JOBS
    _JOBS = (jobs, ptxas, ptx_dir)
    try:
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_check_job, range(len(jobs))))
    finally:
        _JOBS = None


_JOBS: tuple[list[tuple[KernelSpec, str]], Path, Path | None] | None = None
"""The jobs of the running `check_all`, for its forked workers."""


def _check_job(index: int) -> KernelReport:
    assert _JOBS is not None, "set by check_all before the workers fork"
    jobs, ptxas, ptx_dir = _JOBS
    spec, signature = jobs[index]
    return check_kernel(spec, signature, ptxas, ptx_dir)


def format_table(reports: list[KernelReport]) -> str:
    header = ("kernel", "regs", "spill st/ld", "stack", "smem", "status", "signature")
    rows = [header]
    for report in reports:
        usage = report.usage
        status = "ok" if not report.problems else "FAIL"
        if not report.problems and report.spills:
            status = "SPILLS"
        rows.append((
            report.kernel,
            "-" if usage is None else str(usage.registers),
            "-" if usage is None else f"{usage.spill_stores}/{usage.spill_loads}",
            "-" if usage is None else str(usage.stack_bytes),
            "-" if usage is None else str(usage.shared_bytes),
            status,
            report.signature,
        ))  # fmt: skip
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cmpchat.devtools.ptx_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", default=[], help="also import this module (its kernels count)")
    parser.add_argument("--json", type=Path, help="write the reports to this file")
    parser.add_argument("--ptx-dir", type=Path, help="keep each kernel's PTX here")
    parser.add_argument("--ptxas", type=Path, help="ptxas to use (default: the nvidia-cuda-nvcc-cu12 wheel's)")
    parser.add_argument("--fail-on-spills", action="store_true", help="exit 2 when any kernel spills")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8), help="kernels compiled at once")
    args = parser.parse_args(argv)

    from cmpchat.cudart.intrinsics import SIMULATOR

    if SIMULATOR:
        print("ptx_check: NUMBA_ENABLE_CUDASIM is set; the simulator cannot compile PTX", file=sys.stderr)
        return 1
    from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels

    imported, failed = import_kernel_modules(args.module)
    for name, error in failed.items():
        print(f"FAIL import {name}:\n{error}\n", file=sys.stderr)
    ptxas = args.ptxas or find_ptxas()
    jobs = [(spec, signature) for spec in registered_kernels() for signature in spec.signatures]
    reports = check_all(jobs, ptxas, args.ptx_dir, args.jobs)
    print(f"modules: {', '.join(imported)}")
    print(f"ptxas: {ptxas}\n")
    print(format_table(reports))
    for report in reports:
        for problem in report.problems:
            print(f"\nFAIL {report.kernel} {report.signature}: {problem}")
    if args.json:
        payload = {"modules": imported, "failed_modules": failed, "kernels": [_as_json(r) for r in reports]}
        args.json.write_text(json.dumps(payload, indent=1))
    if failed or any(report.problems for report in reports):
        return 1
    if args.fail_on_spills and any(report.spills for report in reports):
        return 2
    exempt = sum(report.kernel in TENSOR_CORE_PROBE_KERNELS for report in reports)
    print(f"\n{len(reports)} kernel signatures: compute_70 PTX free of tensor-core instructions ({exempt} exempt)")
    return 0


def _as_json(report: KernelReport) -> dict:
    return {
        "kernel": report.kernel,
        "signature": report.signature,
        "usage": None if report.usage is None else asdict(report.usage),
        "problems": report.problems,
    }


def _strip_comments(ptx: str) -> str:
    return re.sub(r"//[^\n]*", "", ptx)


if __name__ == "__main__":
    raise SystemExit(main())
