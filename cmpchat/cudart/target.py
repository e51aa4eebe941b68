"""The code path a run compiles and launches: the GPU's own (the default), or the CMP 100-210's on a newer GPU.

`CMPCHAT_PROFILE=cmp` in the environment (or `--profile cmp` on `cmpchat bench` and `cmpchat doctor`, or
`bash cuda/gpu_run.sh MODE --profile cmp`) makes a run on another GPU, the H200, take the path a CMP user's run
takes, as far as one process on that GPU can:

- **compute_70 PTX from CUDA 12's NVVM.** CUDA 12's `libnvvm.so` is loaded before anything else loads an NVVM
  (cuda-bindings and Numba find it through cuda-pathfinder, which takes a library already loaded), with CUDA 12's
  libdevice, and `NUMBA_FORCE_CUDA_CC=7.0` makes every kernel's `-arch` compute_70; Numba's front end is told the
  device is a 7.0 too (what it lowers by cc), as the PTX check's compile is. The PTX is then assembled for the
  GPU at hand as on first launch anywhere (Numba's linker: nvJitLink, or the driver's JIT where it is absent), so
  what runs is sm_90 machine code of the CMP's PTX. NVVM reflects `__CUDA_ARCH` as 700: no `griddepcontrol`, no
  L2 prefetch, `launched_early_here()` false.
- **Its own Numba disk cache** (`NUMBA_CACHE_DIR`; Numba keys its cache on the device's compute capability, not
  on the PTX target, so the two builds must never share one): `$NUMBA_CACHE_DIR/numba-compute_70-cuda12` when
  the environment names a cache folder, else `/tmp/cmpchat-UID/numba-compute_70-cuda12`.
- **The sm_70 row of the device table** (`CMPCHAT_TUNING=sm_70`: SM70_TILING, its launch bounds, no early
  launch) and `CMPCHAT_EARLY_LAUNCH=0`: compute_70 code has no grid-dependency waits, so no launch may start early.
- **68 SMs.** The engine sizes its grids for 68 (`GpuInfo.multiprocessors`, and Numba's device attribute
  `MULTIPROCESSOR_COUNT`, which the doctor's probes size theirs by), and Numba's context on each GPU is a CUDA
  green context of the smallest SM partition the GPU allows that holds 68 (72 on the H200: partitions come in
  multiples of 8 SMs there), so every kernel, graph replay and probe runs on those SMs alone
  (`CMPCHAT_CMP_PARTITION`: `auto`, an SM count, or `off`). The partition is tried when Numba first makes its
  context (stream, module load, raw launch, Numba's own launch, graph capture and replay, a second thread), and
  if any step fails the run goes on in the ordinary context and says so (`status()`, `describe()`).
- **16 GiB per stage**: each pipeline stage plans with at most 16 GiB less what the context already took
  (`stage_memory_cap`, applied in `backends/gpu/device.stage_budgets`), so three stages on one H200 are three
  16 GB cards.

What it leaves out: the CMP's clocks, memory bandwidth (the H200's HBM3e behind 72 SMs), L2 size (the H200's
60 MB against 6 MB) and shared-memory carve-out, the SASS that CUDA 12's ptxas makes for sm_70 (the H200 runs
sm_90 SASS of the same PTX; registers and spills for sm_70 are the PTX check's), the throttled tensor cores and
the PCIe Gen1 x1 link. Speeds measured this way stay H200 speeds of the CMP's code; the projections to the CMP
(`bench/limits.py`, `bench/prefill.py`) scale them by the CMP's bandwidth and dp4a rate as before, from the read
bandwidth and dp4a rate measured in the same mode (the probes' grids sized for 68 SMs too, on the partition), so
the ratios they scale are those of 68 SMs.

The profile applies once per process, before anything compiles: `cudart/compile.py` calls `activate()` when it is
imported (every kernel module imports it), `backends/gpu/device.cuda_gpu_present` before Numba loads an NVVM
(`cuda.is_available()` does), and the GPU tier's pytest plugin (`tests/cmp_profile_plugin.py`) before collection.
Nothing here touches a GPU until Numba makes its context.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import math
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmpchat.errors import CmpchatError

PROFILE_VARIABLE = "CMPCHAT_PROFILE"
"""Names the code path: unset or "native" for the GPU's own, "cmp" for the CMP 100-210's."""
NVVM_VARIABLE = "CMPCHAT_CUDA12_NVVM"
"""A folder holding CUDA 12's `nvvm/lib64/libnvvm.so` and `nvvm/libdevice/libdevice.10.bc` (what
`cuda/fetch_wheels.sh` packs and `cuda/gpu_run.sh` unpacks); without it, the `nvidia-cuda-nvcc-cu12` wheel's."""
PARTITION_VARIABLE = "CMPCHAT_CMP_PARTITION"
"""The green context's SM count in the CMP profile: "auto" (default: the smallest the GPU allows that holds the
CMP's SMs), a number, or "off" (the whole GPU)."""
SM_COUNT_VARIABLE = "CMPCHAT_SM_COUNT"
"""Size the engine's grids for this many SMs on any code path (the CMP profile sets 68 itself); a control: the
native code path at the CMP's SM count changes only summation orders, which is what `cuda/cmp_path_check.py`
calibrates its tolerance by."""
CACHE_NAME = "numba-compute_70-cuda12"
"""The CMP profile's Numba cache folder's name."""
NVCC_WHEEL = "nvidia-cuda-nvcc-cu12"
LIBNVVM = Path("nvvm/lib64/libnvvm.so")
LIBDEVICE = Path("nvvm/libdevice/libdevice.10.bc")
NATIVE = "native"


@dataclass(frozen=True, slots=True)
class CodePath:
    """A card whose code path a run can take on another GPU."""

    name: str
    """How CMPCHAT_PROFILE and --profile name it."""
    card: str
    compute_capability: tuple[int, int]
    """What the PTX is compiled for (NUMBA_FORCE_CUDA_CC) and what Numba's front end is told the device is."""
    tuning: str
    """The device table's row (CMPCHAT_TUNING)."""
    multiprocessors: int
    """The card's SMs: what the engine sizes its grids for, and the least the green context holds."""
    memory_bytes: int
    """The card's memory: what each pipeline stage may plan with, less what the context took."""


CMP = CodePath("cmp", "CMP 100-210", (7, 0), "sm_70", 68, 16 << 30)
PROFILES = {CMP.name: CMP}


@dataclass
class PartitionReport:
    """What became of one GPU's green context."""

    device: int
    requested: int | None = None
    """SMs asked for (None: the partition was off)."""
    granted: int | None = None
    """SMs of the green context in use (None: the ordinary context runs everything)."""
    device_multiprocessors: int | None = None
    seen: int | None = None
    """Distinct SMs the self-test's blocks ran on."""
    reason: str = ""
    """Why no green context is in use, where none is."""


@dataclass
class _State:
    profile: CodePath | None = None
    nvvm: Path | None = None
    libdevice: Path | None = None
    cache_dir: Path | None = None
    partitions: dict[int, PartitionReport] = field(default_factory=dict)
    baseline_used: dict[int, int] = field(default_factory=dict)
    """Bytes each GPU held at the process's first reading (`stage_memory_cap`)."""
    nvvm_handle: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def profile_named(name: str | None) -> CodePath | None:
    """The code path called `name` (None for "native", "" or None); a CmpchatError for any other name."""
    if not name or name == NATIVE:
        return None
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join([NATIVE, *PROFILES])
        raise CmpchatError(f"no code-path profile is called '{name}'; the profiles are {known}") from None


def requested(environ: dict[str, str] | os._Environ[str] | None = None) -> CodePath | None:
    """The profile the environment names (CMPCHAT_PROFILE)."""
    environ = os.environ if environ is None else environ
    return profile_named(environ.get(PROFILE_VARIABLE, "").strip().lower())


def active() -> CodePath | None:
    """The profile this process runs, once `activate` applied it."""
    return _STATE.profile


def activate(name: str | None = None) -> CodePath | None:
    """Apply the profile `name` (default: the one CMPCHAT_PROFILE names) to this process; idempotent.

    Sets the environment Numba and cmpchat read (so subprocesses inherit the profile too), loads CUDA 12's NVVM
    and libdevice, tells Numba's front end the device is the card's, and arranges the green context for when
    Numba first makes its context. Raises CmpchatError where the profile cannot apply: no CUDA 12 NVVM, another
    NVVM already loaded, another profile already active, a CMPCHAT_TUNING that contradicts it.
    """
    if name is not None:
        wanted = profile_named(name)
        if _STATE.profile is not None and wanted is not _STATE.profile:
            raise CmpchatError(f"this process already runs the {_STATE.profile.name} code path; start a new one")
        os.environ[PROFILE_VARIABLE] = name
    profile = requested()
    with _STATE.lock:
        if profile is None or _STATE.profile is profile:
            return _STATE.profile
        if _STATE.profile is not None:
            raise CmpchatError(f"this process already runs the {_STATE.profile.name} code path; start a new one")
        tuning = os.environ.get("CMPCHAT_TUNING")
        if tuning and tuning != profile.tuning:
            raise CmpchatError(
                f"CMPCHAT_PROFILE={profile.name} runs the {profile.tuning} row, but CMPCHAT_TUNING={tuning} asks for "
                "another; unset one"
            )
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return None  # the simulator compiles no PTX and has no SMs: the profile has nothing to apply there
        nvvm, libdevice = find_cuda12_nvvm()
        cache = profile_cache_dir(os.environ)
        os.environ.update(profile_environment(profile, cache))
        _reload_numba_config()
        _STATE.nvvm_handle = _preload_nvvm(nvvm)
        _use_libdevice(libdevice)
        _front_end_compute_capability(profile.compute_capability)
        _install_partitioned_contexts(profile)
        _repoint_registered_caches()
        _STATE.profile, _STATE.nvvm, _STATE.libdevice, _STATE.cache_dir = profile, nvvm, libdevice, cache
        return profile


def profile_environment(profile: CodePath, cache: Path) -> dict[str, str]:
    """The variables the profile sets: Numba's target and cache, the tuning row, no early launch."""
    major, minor = profile.compute_capability
    return {
        "NUMBA_FORCE_CUDA_CC": f"{major}.{minor}",
        "NUMBA_CACHE_DIR": str(cache),
        "CMPCHAT_TUNING": profile.tuning,
        "CMPCHAT_EARLY_LAUNCH": "0",
    }


def profile_cache_dir(environ: dict[str, str] | os._Environ[str]) -> Path:
    """Where the profile's Numba cache lives: under NUMBA_CACHE_DIR when the environment names one (unless that
    is already the profile's, as in a subprocess of an activated process), else under the temporary folder."""
    named = environ.get("NUMBA_CACHE_DIR")
    if named:
        path = Path(named)
        return path if path.name == CACHE_NAME else path / CACHE_NAME
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"cmpchat-{uid}" / CACHE_NAME


def nvvm_candidates(environ: dict[str, str] | os._Environ[str] | None = None) -> list[Path]:
    """Folders that may hold CUDA 12's nvvm/: CMPCHAT_CUDA12_NVVM's, then the nvidia-cuda-nvcc-cu12 wheel's."""
    environ = os.environ if environ is None else environ
    folders = []
    if environ.get(NVVM_VARIABLE):
        folders.append(Path(environ[NVVM_VARIABLE]))
    try:
        wheel = importlib.metadata.distribution(NVCC_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        folders.append(Path(str(wheel.locate_file("nvidia/cuda_nvcc"))))
    return folders


def find_cuda12_nvvm(environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[Path, Path]:
    """(libnvvm.so, libdevice.10.bc) of CUDA 12; a CmpchatError naming where it looked when there is none."""
    folders = nvvm_candidates(environ)
    for folder in folders:
        library, libdevice = folder / LIBNVVM, folder / LIBDEVICE
        if library.is_file() and libdevice.is_file():
            return library.resolve(), libdevice.resolve()
    looked = ", ".join(str(f) for f in folders) or "nowhere"
    raise CmpchatError(
        f"the CMP code path needs CUDA 12's NVVM: set {NVVM_VARIABLE} to a folder holding {LIBNVVM} and {LIBDEVICE}, "
        f"or install {NVCC_WHEEL} (looked in: {looked}); on the GPU machine, carry .whl-cmp (cuda/fetch_wheels.sh)"
    )


def _reload_numba_config() -> None:
    """Numba reads NUMBA_* at import and again whenever the environment changed; read it now if it is loaded."""
    config = sys.modules.get("numba.core.config")
    if config is not None:
        config.reload_config()


def _loaded_nvvm_path() -> str | None:
    """The file of the libnvvm already in this process, if any (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libnvvm.so" in Path(path).name:
            return path
    return None


def _preload_nvvm(library: Path) -> Any:
    """Load CUDA 12's libnvvm globally, so cuda-pathfinder (cuda-bindings' and Numba's loader) takes it."""
    loaded = _loaded_nvvm_path()
    if loaded is not None and Path(loaded).resolve() != library:
        raise CmpchatError(
            f"another NVVM ({loaded}) is already loaded in this process: select the CMP code path before anything "
            "compiles (CMPCHAT_PROFILE=cmp in the environment)"
        )
    return ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)


def _use_libdevice(libdevice: Path) -> None:
    """Numba links libdevice into every kernel; give it CUDA 12's (its IR matches CUDA 12's NVVM)."""
    from numba.cuda.cudadrv import nvvm

    data = libdevice.read_bytes()
    if data[:4] != b"BC\xc0\xde":
        raise CmpchatError(f"{libdevice} is not LLVM bitcode")
    nvvm.LibDevice._cache_ = data


class _DeviceAs:
    """A Numba device that reports another compute capability (all else is the real device's)."""

    def __init__(self, device: Any, compute_capability: tuple[int, int]) -> None:
        self._device = device
        self.compute_capability = compute_capability

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)


def _front_end_compute_capability(compute_capability: tuple[int, int]) -> None:
    """Numba's dispatchers lower each kernel for the current device's compute capability (numba-cuda 0.30,
    `_Kernel.__init__`, `compile_device`); make that the card's, as the PTX check's `compile_ptx(cc=...)` does.
    The linker still assembles for the real device (`CUDACodeLibrary._ensure_cc` asks the context)."""
    import numba.cuda.dispatcher as numba_dispatcher

    real = numba_dispatcher.get_current_device
    if getattr(real, "cmpchat_code_path", None) is not None:
        return

    def current_device() -> Any:
        return _DeviceAs(real(), compute_capability)

    current_device.cmpchat_code_path = compute_capability  # type: ignore[attr-defined]
    numba_dispatcher.get_current_device = current_device


def _repoint_registered_caches() -> None:
    """Kernels defined before the profile applied chose their cache folder then; choose again (Numba picks it
    when caching is enabled). `cudart.compile` is looked up, not imported: it imports this module."""
    registry = sys.modules.get("cmpchat.cudart.compile")
    for spec in getattr(registry, "KERNELS", ()):
        if type(getattr(spec.dispatcher, "_cache", None)).__name__ == "CUDACache":
            spec.dispatcher.enable_caching()


# --- SMs -----------------------------------------------------------------------------------------------------


def partition_request(profile: CodePath, environ: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """SMs the green context should hold at least (None: no partition), from CMPCHAT_CMP_PARTITION."""
    environ = os.environ if environ is None else environ
    value = environ.get(PARTITION_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return profile.multiprocessors
    if value in ("off", "0", "none"):
        return None
    try:
        count = int(value)
    except ValueError:
        raise CmpchatError(f"{PARTITION_VARIABLE} takes auto, off or an SM count, not '{value}'") from None
    if count < profile.multiprocessors:
        raise CmpchatError(f"{PARTITION_VARIABLE}={count}: the partition must hold the {profile.multiprocessors} SMs")
    return count


def aligned_partition(wanted: int, compute_capability: tuple[int, int], minimum: int = 0, alignment: int = 0) -> int:
    """The smallest SM count a green context can have that holds `wanted`: a multiple of the alignment the driver
    reports (CUDA 13's `smCoscheduledAlignment`, `minSmPartitionSize`), else of the documented granularity for
    `cuDevSmResourceSplitByCount` (8 from sm_90, 2 below; at least 8 from sm_90, 4 on sm_8x, 2 on sm_7x)."""
    if alignment <= 0:
        alignment = 8 if compute_capability >= (9, 0) else 2 if compute_capability >= (7, 0) else 1
    if minimum <= 0:
        minimum = {9: 8, 8: 4, 7: 2}.get(min(compute_capability[0], 9), 1)
    return max(minimum, math.ceil(wanted / alignment) * alignment)


def engine_multiprocessors(real: int) -> int:
    """The SM count the engine sizes its grids by: the profile's card's (never more than the GPU has), or
    CMPCHAT_SM_COUNT's, else the GPU's own."""
    profile = _STATE.profile
    if profile is not None:
        return min(profile.multiprocessors, real)
    value = os.environ.get(SM_COUNT_VARIABLE)
    if value:
        try:
            return max(1, min(int(value), real))
        except ValueError:
            raise CmpchatError(f"{SM_COUNT_VARIABLE} takes an SM count, not '{value}'") from None
    return real


def gpu_name(name: str) -> str:
    """How reports name the GPU: with the code path when it is not the GPU's own."""
    profile = _STATE.profile
    return name if profile is None else f"{name} ({profile.card} code path)"


def stage_memory_cap(device: int, free_bytes: int, total_bytes: int) -> int | None:
    """The most one pipeline stage may plan with under the profile: the card's memory less what the GPU held
    when the process first asked (its context: a real card's holds about as much); None on the native path.

    The first reading per GPU stands, so memory the process itself holds later (a backend not yet freed) is not
    charged twice: the stage's share of what is free caps it as well (`stage_budgets`)."""
    profile = _STATE.profile
    if profile is None:
        return None
    used = _STATE.baseline_used.setdefault(device, max(total_bytes - free_bytes, 0))
    return max(profile.memory_bytes - used, 0)


# Blocks record the SM they ran on, then sleep, so later blocks must go to other SMs: the distinct ids are the SMs
# launches on this context can use. Plain PTX for compute_70 (nanosleep needs sm_70 and PTX ISA 6.3), loaded
# through the driver, so the check does not depend on Numba compiling.
SM_IDS_PTX = b"""
.version 6.4
.target sm_70
.address_size 64

.visible .entry cmpchat_sm_ids(
\t.param .u64 cmpchat_sm_ids_out,
\t.param .u32 cmpchat_sm_ids_sleep_ns
)
{
\t.reg .pred %p<2>;
\t.reg .b32 %r<6>;
\t.reg .b64 %rd<5>;

\tld.param.u64 %rd1, [cmpchat_sm_ids_out];
\tld.param.u32 %r4, [cmpchat_sm_ids_sleep_ns];
\tmov.u32 %r1, %smid;
\tmov.u32 %r2, %ctaid.x;
\tmov.u32 %r3, %tid.x;
\tsetp.ne.s32 %p1, %r3, 0;
\t@%p1 bra $L_sleep;
\tcvta.to.global.u64 %rd2, %rd1;
\tmul.wide.u32 %rd3, %r2, 4;
\tadd.s64 %rd4, %rd2, %rd3;
\tst.global.u32 [%rd4], %r1;
$L_sleep:
\tnanosleep.u32 %r4;
\tret;
}
\x00"""
SM_IDS_ENTRY = b"cmpchat_sm_ids"
SM_IDS_BLOCKS = 4096
SM_IDS_SLEEP_NS = 200_000


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(call: str, result: tuple[Any, ...]) -> Any:
    from cmpchat.cudart.driver_api import check

    return check(call, result)


def _launch_params(*values: tuple[str, int]) -> tuple[Any, Any, int]:
    """Kernel parameters packed as the driver takes them: (buffer, pointer array, its address)."""
    import struct

    formats = "".join(code for code, _ in values)
    sizes = [struct.calcsize(code) for code, _ in values]
    offsets = [sum(sizes[:i]) for i in range(len(values))]
    buffer = ctypes.create_string_buffer(struct.pack("<" + formats, *(value for _, value in values)), sum(sizes))
    base = ctypes.addressof(buffer)
    pointers = (ctypes.c_void_p * len(values))(*(base + offset for offset in offsets))
    return buffer, pointers, ctypes.addressof(pointers)


def sm_ids_used(stream: int, blocks: int = SM_IDS_BLOCKS, *, graph: bool = False) -> int:
    """Distinct SMs that `blocks` sleeping blocks launched on `stream` (a raw handle; the current context's) ran
    on, through the driver (`cuLaunchKernel`, or a captured graph's replay with `graph`)."""
    driver = _driver()
    module = _check("cuModuleLoadData", driver.cuModuleLoadData(SM_IDS_PTX))
    try:
        function = _check("cuModuleGetFunction", driver.cuModuleGetFunction(module, SM_IDS_ENTRY))
        out = _check("cuMemAlloc", driver.cuMemAlloc(4 * blocks))
        try:
            _buffer, _pointers, params = _launch_params(("Q", int(out)), ("I", SM_IDS_SLEEP_NS))
            _check("cuMemsetD32", driver.cuMemsetD32(out, 0xFFFFFFFF, blocks))
            if graph:
                mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                _check("cuStreamBeginCapture", driver.cuStreamBeginCapture(stream, mode))
                try:
                    _check("cuLaunchKernel", driver.cuLaunchKernel(function, blocks, 1, 1, 32, 1, 1, 0, stream,
                                                                   params, 0))  # fmt: skip
                finally:
                    captured = _check("cuStreamEndCapture", driver.cuStreamEndCapture(stream))
                executable = _check("cuGraphInstantiate", driver.cuGraphInstantiate(captured, 0))
                _check("cuGraphLaunch", driver.cuGraphLaunch(executable, stream))
                _check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
                _check("cuGraphExecDestroy", driver.cuGraphExecDestroy(executable))
                _check("cuGraphDestroy", driver.cuGraphDestroy(captured))
            else:
                _check("cuLaunchKernel", driver.cuLaunchKernel(function, blocks, 1, 1, 32, 1, 1, 0, stream, params, 0))
                _check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
            host = (ctypes.c_uint32 * blocks)()
            _check("cuMemcpyDtoH", driver.cuMemcpyDtoH(ctypes.addressof(host), out, 4 * blocks))
        finally:
            _check("cuMemFree", driver.cuMemFree(out))
    finally:
        _check("cuModuleUnload", driver.cuModuleUnload(module))
    ids = set(host)
    if 0xFFFFFFFF in ids:
        raise CmpchatError("the SM-id probe's blocks did not all run")
    return len(ids)


def _sm_ids_through_cuda_core(stream: int, blocks: int) -> int:
    """As `sm_ids_used`, launched the way Numba launches (cuda.core's `launch` of a library's kernel)."""
    import numpy as np
    from cuda.core import LaunchConfig, launch
    from numba.cuda.cudadrv.driver import ExperimentalStream, ObjectCode

    driver = _driver()
    kernel = ObjectCode.from_ptx(SM_IDS_PTX).get_kernel(SM_IDS_ENTRY.decode())
    out = _check("cuMemAlloc", driver.cuMemAlloc(4 * blocks))
    try:
        _check("cuMemsetD32", driver.cuMemsetD32(out, 0xFFFFFFFF, blocks))
        core_stream = ExperimentalStream.from_handle(int(stream))
        # cuda.core takes numpy scalars for the pointer and the count (not ctypes' c_void_p, as the GPU said)
        launch(core_stream, LaunchConfig(grid=blocks, block=32), kernel, np.uint64(int(out)),
               np.uint32(SM_IDS_SLEEP_NS))  # fmt: skip
        _check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
        host = (ctypes.c_uint32 * blocks)()
        _check("cuMemcpyDtoH", driver.cuMemcpyDtoH(ctypes.addressof(host), out, 4 * blocks))
    finally:
        _check("cuMemFree", driver.cuMemFree(out))
    ids = set(host)
    if 0xFFFFFFFF in ids:
        raise CmpchatError("the SM-id probe's blocks did not all run (cuda.core launch)")
    return len(ids)


def _green_context(device_id: int, wanted: int) -> tuple[Any, Any, int, int]:
    """(green context, its CUcontext, SMs granted, SMs of the device) for a partition holding `wanted` SMs."""
    driver = _driver()
    device = _check("cuDeviceGet", driver.cuDeviceGet(device_id))
    sm_type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    resource = _check("cuDeviceGetDevResource", driver.cuDeviceGetDevResource(device, sm_type))
    total = int(resource.sm.smCount)
    major = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))  # fmt: skip
    minor = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))  # fmt: skip
    count = aligned_partition(
        wanted,
        (int(major), int(minor)),
        int(getattr(resource.sm, "minSmPartitionSize", 0) or 0),
        int(getattr(resource.sm, "smCoscheduledAlignment", 0) or 0),
    )
    if count >= total:
        raise CmpchatError(f"a {count}-SM partition is the whole {total}-SM GPU")
    groups, made, _rest = _check(
        "cuDevSmResourceSplitByCount", driver.cuDevSmResourceSplitByCount(1, resource, 0, count)
    )
    if int(made) < 1:
        raise CmpchatError(f"the driver made no {count}-SM group")
    group = groups[0]
    granted = int(group.sm.smCount)
    description = _check("cuDevResourceGenerateDesc", driver.cuDevResourceGenerateDesc([group], 1))
    flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
    green = _check("cuGreenCtxCreate", driver.cuGreenCtxCreate(description, device, flags))
    try:
        context = _check("cuCtxFromGreenCtx", driver.cuCtxFromGreenCtx(green))
    except Exception:
        driver.cuGreenCtxDestroy(green)
        raise
    return green, context, granted, total


def _self_test(context: Any, granted: int) -> int:
    """Run, in the green context, what the engine will: a blocking stream, a module load, raw launches, Numba's
    launch path, a graph capture and replay, and an allocation from a second thread. Returns the distinct SMs
    seen; raises on any failure or if launches ran on more SMs than the partition has."""
    driver = _driver()
    _check("cuCtxPushCurrent", driver.cuCtxPushCurrent(context))
    try:
        stream = _check("cuStreamCreate", driver.cuStreamCreate(0))  # blocking, as Numba's cuda.stream()
        try:
            seen = max(
                sm_ids_used(int(stream)),
                sm_ids_used(int(stream), graph=True),
                _sm_ids_through_cuda_core(int(stream), SM_IDS_BLOCKS),
            )
        finally:
            _check("cuStreamDestroy", driver.cuStreamDestroy(stream))
        problems: list[BaseException] = []

        def other_thread() -> None:
            try:
                _check("cuCtxPushCurrent", driver.cuCtxPushCurrent(context))
                try:
                    memory = _check("cuMemAlloc", driver.cuMemAlloc(1 << 20))
                    _check("cuMemFree", driver.cuMemFree(memory))
                finally:
                    _check("cuCtxPopCurrent", driver.cuCtxPopCurrent())
            except BaseException as error:  # reported in the calling thread
                problems.append(error)

        thread = threading.Thread(target=other_thread, name="cmpchat-green-context-check")
        thread.start()
        thread.join()
        if problems:
            raise problems[0]
    finally:
        _check("cuCtxPopCurrent", driver.cuCtxPopCurrent())
    if seen > granted:
        raise CmpchatError(f"launches ran on {seen} SMs, more than the partition's {granted}")
    return seen


def partition(profile: CodePath, device: int) -> tuple[Any, Any, PartitionReport]:
    """(green context, its CUcontext, report) for GPU `device` under `profile`: the green context of the partition
    `CMPCHAT_CMP_PARTITION` asks for, checked by `_self_test`; (None, None, report with the reason) where there
    is none (off, unsupported, or it failed its check: the ordinary context runs everything then)."""
    report = PartitionReport(device, requested=partition_request(profile))
    if report.requested is None:
        report.reason = f"{PARTITION_VARIABLE}=off"
        return None, None, report
    try:
        green, context, granted, total = _green_context(device, report.requested)
    except Exception as error:  # no green contexts here: run on the whole GPU, and say so
        report.reason = f"{type(error).__name__}: {error}"
        return None, None, report
    report.device_multiprocessors = total
    try:
        report.seen = _self_test(context, granted)
    except Exception as error:
        report.reason = f"the green context failed its check: {type(error).__name__}: {error}"
        _driver().cuGreenCtxDestroy(green)
        return None, None, report
    report.granted = granted
    return green, context, report


def _install_partitioned_contexts(profile: CodePath) -> None:
    """Make the context Numba creates for each GPU a green context of the profile's partition (its own class
    stands in for Numba's `Context`, which Numba constructs once per device, in `Device.get_primary_context`), and
    make the device report the card's SM count."""
    from numba.cuda.cudadrv import driver as numba_driver

    base = numba_driver.Context
    if getattr(base, "cmpchat_code_path", None) is not None:
        return

    class PartitionedContext(base):  # type: ignore[misc, valid-type]
        cmpchat_code_path = profile.name

        def __init__(self, device: Any, handle: Any) -> None:
            green, context, report = partition(profile, int(device.id))
            self.green_context, self.primary_handle = green, handle
            if report.device_multiprocessors is None:
                report.device_multiprocessors = int(device.MULTIPROCESSOR_COUNT)
            super().__init__(device, handle if context is None else context)
            # What a CMP reports: the doctor's probes and anything else that asks Numba size their grids by it.
            device.MULTIPROCESSOR_COUNT = min(profile.multiprocessors, report.device_multiprocessors)
            _STATE.partitions[report.device] = report
            if report.granted is None:
                where = f"all of its {report.device_multiprocessors} SMs: {report.reason}"
            else:
                where = f"a {report.granted}-SM green context of its {report.device_multiprocessors} SMs"
            print(f"cmpchat: GPU {report.device} runs the {profile.card} code path on {where}", file=sys.stderr,
                  flush=True)  # fmt: skip

    PartitionedContext.__name__ = PartitionedContext.__qualname__ = "PartitionedContext"
    numba_driver.Context = PartitionedContext


# --- reports --------------------------------------------------------------------------------------------------


def status() -> dict[str, Any]:
    """What the process runs, for reports and JSON: the profile, its NVVM, cache, tuning and each GPU's partition."""
    profile = _STATE.profile
    if profile is None:
        return {"profile": NATIVE}
    return {
        "profile": profile.name,
        "card": profile.card,
        "ptx_target": "compute_{}{}".format(*profile.compute_capability),
        "nvvm": None if _STATE.nvvm is None else str(_STATE.nvvm),
        "libdevice": None if _STATE.libdevice is None else str(_STATE.libdevice),
        "numba_cache": None if _STATE.cache_dir is None else str(_STATE.cache_dir),
        "tuning": os.environ.get("CMPCHAT_TUNING"),
        "early_launch": os.environ.get("CMPCHAT_EARLY_LAUNCH", "1") != "0",
        "engine_multiprocessors": profile.multiprocessors,
        "stage_memory_bytes": profile.memory_bytes,
        "partitions": {index: vars(report) for index, report in sorted(_STATE.partitions.items())},
    }


def describe() -> list[str]:
    """One line per fact of the code path this process runs (nothing on the native path)."""
    profile = _STATE.profile
    if profile is None:
        return []
    lines = [
        f"code path: the {profile.card}'s, on this GPU (CMPCHAT_PROFILE={profile.name})",
        f"  PTX: compute_{profile.compute_capability[0]}{profile.compute_capability[1]} from CUDA 12's NVVM "
        f"({_STATE.nvvm}), libdevice {_STATE.libdevice}; Numba cache {_STATE.cache_dir}",
        f"  tuning row {os.environ.get('CMPCHAT_TUNING')}, early launch off; grids sized for {profile.multiprocessors}"
        f" SMs; each stage's memory capped at {profile.memory_bytes / 2**30:.0f} GiB",
    ]
    for index, report in sorted(_STATE.partitions.items()):
        if report.granted is not None:
            lines.append(f"  GPU {index}: a {report.granted}-SM green context of its {report.device_multiprocessors} "
                         f"SMs (its check's blocks ran on {report.seen})")  # fmt: skip
        else:
            lines.append(f"  GPU {index}: all {report.device_multiprocessors} SMs, no partition ({report.reason})")
    return lines


def add_profile_option(parser: argparse.ArgumentParser) -> None:
    """`--profile {native,cmp}` on a command that compiles kernels."""
    parser.add_argument(
        "--profile",
        choices=[NATIVE, *PROFILES],
        help="the code path to run: this GPU's own (native, the default) or the CMP 100-210's (cmp: compute_70 PTX "
        "from CUDA 12's NVVM, the sm_70 tuning row, no early launch, 68 SMs, 16 GiB per stage); also CMPCHAT_PROFILE",
    )


def apply_profile_option(args: argparse.Namespace) -> None:
    """Apply `--profile`, or else CMPCHAT_PROFILE (before the command imports any kernel); under a profile, say on
    stderr what the code path is (each GPU's partition is said when its context is made)."""
    name = getattr(args, "profile", None)
    if name == NATIVE:
        if _STATE.profile is not None:
            raise CmpchatError(f"this process already runs the {_STATE.profile.name} code path")
        os.environ[PROFILE_VARIABLE] = NATIVE
        return
    if activate(name) is not None:
        print("\n".join(f"cmpchat: {line.strip()}" for line in describe()), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m cmpchat.cudart.target [--profile cmp]`: apply the profile, make GPU 0's context, print the status."""
    import json

    parser = argparse.ArgumentParser(prog="python -m cmpchat.cudart.target", description=main.__doc__)
    add_profile_option(parser)
    parser.add_argument("--no-gpu", action="store_true", help="only apply the profile (no context is made)")
    args = parser.parse_args(argv)
    apply_profile_option(args)
    if not args.no_gpu and _STATE.profile is not None:
        from numba import cuda

        cuda.current_context()
    print(json.dumps(status(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
