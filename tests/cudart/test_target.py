"""The code-path profile (`cmpchat/cudart/target.py`, issue 34) on the CPU: its settings and their wiring, the
green context's set-up and self-test against a fake driver, and, in a subprocess without the simulator, a
process that takes the CMP code path compiling compute_70 PTX with CUDA 12's NVVM into its own cache."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cmpchat.backends.gpu.device import GpuInfo, stage_budgets
from cmpchat.cudart import target
from cmpchat.cudart.driver_api import SUCCESS
from cmpchat.errors import CmpchatError

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def test_profiles_are_named_native_or_cmp():
    assert target.profile_named(None) is None and target.profile_named("") is None
    assert target.profile_named("native") is None
    assert target.profile_named("cmp") is target.CMP
    assert target.requested({"CMPCHAT_PROFILE": " CMP "}) is target.CMP
    assert target.requested({}) is None
    with pytest.raises(CmpchatError, match="native, cmp"):
        target.profile_named("sm_70")


def test_the_cmp_profile_is_the_cards():
    assert target.CMP.compute_capability == (7, 0) and target.CMP.tuning == "sm_70"
    assert target.CMP.multiprocessors == 68 and target.CMP.memory_bytes == 16 * GIB


def test_the_environment_it_sets(tmp_path: Path):
    assert target.profile_environment(target.CMP, tmp_path) == {
        "NUMBA_FORCE_CUDA_CC": "7.0",
        "NUMBA_CACHE_DIR": str(tmp_path),
        "CMPCHAT_TUNING": "sm_70",
        "CMPCHAT_EARLY_LAUNCH": "0",
    }


def test_its_numba_cache_is_never_the_native_builds(tmp_path: Path):
    """Numba keys its cache on the device's compute capability, not the PTX target: the two builds must not share
    a folder. The native build caches beside the sources (or in NUMBA_CACHE_DIR itself); the CMP one in a
    folder of its own, and a subprocess of a CMP process keeps that folder rather than nesting another."""
    default = target.profile_cache_dir({})
    assert default.name == target.CACHE_NAME and REPO not in default.parents
    named = target.profile_cache_dir({"NUMBA_CACHE_DIR": str(tmp_path)})
    assert named == tmp_path / target.CACHE_NAME != tmp_path
    assert target.profile_cache_dir({"NUMBA_CACHE_DIR": str(named)}) == named


def test_the_partition_asked_for():
    assert target.partition_request(target.CMP, {}) == 68
    assert target.partition_request(target.CMP, {"CMPCHAT_CMP_PARTITION": "auto"}) == 68
    assert target.partition_request(target.CMP, {"CMPCHAT_CMP_PARTITION": "off"}) is None
    assert target.partition_request(target.CMP, {"CMPCHAT_CMP_PARTITION": "72"}) == 72
    with pytest.raises(CmpchatError, match="must hold the 68"):
        target.partition_request(target.CMP, {"CMPCHAT_CMP_PARTITION": "64"})
    with pytest.raises(CmpchatError, match="auto, off or an SM count"):
        target.partition_request(target.CMP, {"CMPCHAT_CMP_PARTITION": "half"})


def test_partitions_come_in_the_devices_multiples():
    """68 SMs on an H200 (partitions in multiples of 8 from sm_90) is a 72-SM green context; the driver's own
    alignment, where it reports one (CUDA 13), wins."""
    assert target.aligned_partition(68, (9, 0)) == 72
    assert target.aligned_partition(68, (10, 0)) == 72
    assert target.aligned_partition(68, (8, 6)) == 68
    assert target.aligned_partition(68, (7, 0)) == 68
    assert target.aligned_partition(68, (9, 0), minimum=8, alignment=16) == 80
    assert target.aligned_partition(4, (9, 0)) == 8


def nvvm_folder(root: Path) -> Path:
    for relative in (target.LIBNVVM, target.LIBDEVICE):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(b"BC\xc0\xde")
    return root


def test_cuda12_nvvm_is_found_where_the_variable_says_first(tmp_path: Path):
    folder = nvvm_folder(tmp_path / "cuda12")
    library, libdevice = target.find_cuda12_nvvm({target.NVVM_VARIABLE: str(folder)})
    assert library == (folder / target.LIBNVVM).resolve() and libdevice == (folder / target.LIBDEVICE).resolve()
    assert target.nvvm_candidates({target.NVVM_VARIABLE: str(folder)})[0] == folder


def test_no_cuda12_nvvm_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(target, "nvvm_candidates", lambda environ=None: [tmp_path])
    with pytest.raises(CmpchatError, match=target.NVVM_VARIABLE):
        target.find_cuda12_nvvm({})


@pytest.fixture
def cmp_active(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The CMP profile as `activate` leaves it, without its process-wide side effects."""
    state = target._State(profile=target.CMP)
    monkeypatch.setattr(target, "_STATE", state)
    return state


def test_the_engine_sizes_its_grids_for_68_sms(cmp_active: Any):
    assert target.engine_multiprocessors(132) == 68
    assert target.engine_multiprocessors(40) == 40  # never more than the GPU has
    assert target.gpu_name("NVIDIA H200") == "NVIDIA H200 (CMP 100-210 code path)"


def test_the_native_path_keeps_the_gpus_own(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(target, "_STATE", target._State())
    monkeypatch.delenv(target.SM_COUNT_VARIABLE, raising=False)
    assert target.engine_multiprocessors(132) == 132 and target.gpu_name("NVIDIA H200") == "NVIDIA H200"
    assert target.stage_memory_cap(0, 139 * GIB, 141 * GIB) is None
    monkeypatch.setenv(target.SM_COUNT_VARIABLE, "68")  # the control run of cuda/cmp_path_check.py
    assert target.engine_multiprocessors(132) == 68


def test_each_stage_plans_with_a_16_gib_card(cmp_active: Any):
    """16 GiB less what the GPU held at the first reading (its context), for one stage or three on one GPU; a
    smaller --gpu-mem still wins, and memory the process takes later is not charged twice."""
    h200 = GpuInfo(0, "NVIDIA H200", (9, 0), free_bytes=140 * GIB, total_bytes=141 * GIB, multiprocessors=68)
    card = 15 * GIB
    assert stage_budgets([h200], None) == [card]
    assert stage_budgets([h200] * 3, None) == [card] * 3
    assert stage_budgets([h200] * 3, 8 * GIB) == [8 * GIB] * 3
    later = GpuInfo(0, "NVIDIA H200", (9, 0), free_bytes=100 * GIB, total_bytes=141 * GIB, multiprocessors=68)
    assert stage_budgets([later], None) == [card]
    small = GpuInfo(1, "small", (9, 0), free_bytes=10 * GIB, total_bytes=11 * GIB, multiprocessors=68)
    assert stage_budgets([small], None) == [10 * GIB]  # what is free still caps it


def test_tuning_that_contradicts_the_profile_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(target, "_STATE", target._State())
    monkeypatch.setenv("CMPCHAT_PROFILE", "cmp")
    monkeypatch.setenv("CMPCHAT_TUNING", "sm_90")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    with pytest.raises(CmpchatError, match="CMPCHAT_TUNING=sm_90"):
        target.activate()


def test_under_the_simulator_nothing_applies(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(target, "_STATE", target._State())
    monkeypatch.setenv("CMPCHAT_PROFILE", "cmp")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert target.activate() is None and target.active() is None and target.describe() == []
    assert target.status() == {"profile": "native"}


def test_the_options_of_the_commands():
    from cmpchat.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "decode", "9B", "--profile", "cmp"]).profile == "cmp"
    assert parser.parse_args(["bench", "prefill", "27B", "--gpus", "0,0,0", "--profile", "cmp"]).profile == "cmp"
    assert parser.parse_args(["doctor", "--quick", "--profile", "cmp"]).profile == "cmp"
    assert parser.parse_args(["doctor"]).profile is None
    with pytest.raises(SystemExit):
        parser.parse_args(["doctor", "--profile", "sm_70"])


# --- the green context against a fake driver ---------------------------------------------------------------------


class FakeDriver:
    """The driver calls the green context's set-up and self-test make, on a GPU of `sms` SMs whose green contexts
    put blocks on `partition_sms` SMs. Kernel parameters are read back from the pointers the launch passes."""

    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major", CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor"
    )
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=2)

    def __init__(self, sms: int = 132, partition_sms: int | None = None, fail: str = "") -> None:
        self.sms, self.partition_sms, self.fail = sms, partition_sms, fail
        self.memory: dict[int, bytearray] = {}
        self.next_address = 0x1000
        self.stacks = threading.local()
        self.calls: list[str] = []
        self.launches: list[tuple[int, int, int]] = []
        self.captured: list[tuple[int, int]] | None = None
        self.split: tuple[int, int] | None = None
        self.destroyed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    def _ok(self, call: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(call)
        if call == self.fail:
            raise RuntimeError(f"{call} is not supported")
        return (SUCCESS, *values)

    def _stack(self) -> list:
        if not hasattr(self.stacks, "items"):
            self.stacks.items = []
        return self.stacks.items

    def cuDeviceGet(self, index: int) -> tuple:
        return self._ok("cuDeviceGet", index)

    def cuDeviceGetDevResource(self, device: int, kind: int) -> tuple:
        return self._ok("cuDeviceGetDevResource", SimpleNamespace(sm=SimpleNamespace(smCount=self.sms)))

    def cuDeviceGetAttribute(self, attribute: str, device: int) -> tuple:
        return self._ok("cuDeviceGetAttribute", 9 if attribute == "major" else 0)

    def cuDevSmResourceSplitByCount(self, groups: int, resource: Any, flags: int, count: int) -> tuple:
        self.split = (groups, count)
        group = SimpleNamespace(sm=SimpleNamespace(smCount=count))
        rest = SimpleNamespace(sm=SimpleNamespace(smCount=self.sms - count))
        return self._ok("cuDevSmResourceSplitByCount", [group], 1, rest)

    def cuDevResourceGenerateDesc(self, resources: list, count: int) -> tuple:
        return self._ok("cuDevResourceGenerateDesc", ("desc", resources[0].sm.smCount))

    def cuGreenCtxCreate(self, description: Any, device: int, flags: int) -> tuple:
        return self._ok("cuGreenCtxCreate", "green")

    def cuCtxFromGreenCtx(self, green: str) -> tuple:
        return self._ok("cuCtxFromGreenCtx", "green-context")

    def cuGreenCtxDestroy(self, green: str) -> tuple:
        self.destroyed.append(green)
        return (SUCCESS,)

    def cuCtxPushCurrent(self, context: str) -> tuple:
        self._stack().append(context)
        return self._ok("cuCtxPushCurrent")

    def cuCtxPopCurrent(self) -> tuple:
        return self._ok("cuCtxPopCurrent", self._stack().pop())

    def cuStreamCreate(self, flags: int) -> tuple:
        assert flags == 0  # blocking, as Numba's streams
        return self._ok("cuStreamCreate", 77)

    def cuStreamDestroy(self, stream: int) -> tuple:
        return self._ok("cuStreamDestroy")

    def cuModuleLoadData(self, image: bytes) -> tuple:
        assert image.startswith(b"\n.version") and image.endswith(b"\x00")
        return self._ok("cuModuleLoadData", "module")

    def cuModuleGetFunction(self, module: str, name: bytes) -> tuple:
        assert name == target.SM_IDS_ENTRY
        return self._ok("cuModuleGetFunction", "function")

    def cuModuleUnload(self, module: str) -> tuple:
        return self._ok("cuModuleUnload")

    def cuMemAlloc(self, size: int) -> tuple:
        address, self.next_address = self.next_address, self.next_address + size + 0x1000
        self.memory[address] = bytearray(size)
        return self._ok("cuMemAlloc", address)

    def cuMemFree(self, address: int) -> tuple:
        del self.memory[address]
        return self._ok("cuMemFree")

    def cuMemsetD32(self, address: int, value: int, count: int) -> tuple:
        self.memory[address][: 4 * count] = value.to_bytes(4, "little") * count
        return self._ok("cuMemsetD32")

    def cuLaunchKernel(self, function: str, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: int, params: int, extra: int) -> tuple:  # fmt: skip
        pointers = (ctypes.c_uint64 * 2).from_address(params)
        out = ctypes.c_uint64.from_address(pointers[0]).value
        sleep = ctypes.c_uint32.from_address(pointers[1]).value
        assert sleep == target.SM_IDS_SLEEP_NS and (gy, gz, bx, by, bz, shared) == (1, 1, 32, 1, 1, 0)
        if self.captured is not None:
            self.captured.append((out, gx))
        else:
            self._run(out, gx)
        return self._ok("cuLaunchKernel")

    def _run(self, out: int, blocks: int) -> None:
        sms = self.partition_sms or self.sms
        for block in range(blocks):
            self.memory[out][4 * block : 4 * block + 4] = (block % sms).to_bytes(4, "little")
        self.launches.append((out, blocks, sms))

    def cuStreamSynchronize(self, stream: int) -> tuple:
        return self._ok("cuStreamSynchronize")

    def cuMemcpyDtoH(self, host: int, device: int, size: int) -> tuple:
        data = bytes(self.memory[device][:size])
        ctypes.memmove(host, data, size)
        return self._ok("cuMemcpyDtoH")

    def cuStreamBeginCapture(self, stream: int, mode: int) -> tuple:
        self.captured = []
        return self._ok("cuStreamBeginCapture")

    def cuStreamEndCapture(self, stream: int) -> tuple:
        graph, self.captured = self.captured, None
        return self._ok("cuStreamEndCapture", graph)

    def cuGraphInstantiate(self, graph: list, flags: int) -> tuple:
        return self._ok("cuGraphInstantiate", graph)

    def cuGraphLaunch(self, executable: list, stream: int) -> tuple:
        for out, blocks in executable:
            self._run(out, blocks)
        return self._ok("cuGraphLaunch")

    def cuGraphExecDestroy(self, executable: list) -> tuple:
        return self._ok("cuGraphExecDestroy")

    def cuGraphDestroy(self, graph: list) -> tuple:
        return self._ok("cuGraphDestroy")


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(driver: FakeDriver, core_sms: int | None = None) -> FakeDriver:
        monkeypatch.setattr(target, "_driver", lambda: driver)
        monkeypatch.setattr(
            target, "_sm_ids_through_cuda_core", lambda stream, blocks: core_sms or driver.partition_sms
        )
        monkeypatch.delenv(target.PARTITION_VARIABLE, raising=False)
        return driver

    return install


def test_a_72_sm_green_context_for_68_sms_on_an_h200(fake_driver: Any):
    driver = fake_driver(FakeDriver(sms=132, partition_sms=72))
    green, context, report = target.partition(target.CMP, 0)
    assert (green, context) == ("green", "green-context")
    assert driver.split == (1, 72)
    assert (report.requested, report.granted, report.device_multiprocessors, report.seen) == (68, 72, 132, 72)
    assert report.reason == "" and driver.destroyed == []
    # raw launch and graph replay, each of every block, in the green context, pushed and popped in each thread
    assert [blocks for _, blocks, _ in driver.launches] == [target.SM_IDS_BLOCKS] * 2
    assert driver.calls.count("cuCtxPushCurrent") == driver.calls.count("cuCtxPopCurrent") == 2
    assert driver.memory == {}  # everything it allocated is freed


def test_a_partition_the_launches_overrun_is_given_up(fake_driver: Any):
    driver = fake_driver(FakeDriver(sms=132, partition_sms=132))
    green, context, report = target.partition(target.CMP, 0)
    assert (green, context, report.granted) == (None, None, None)
    assert "ran on 132 SMs, more than the partition's 72" in report.reason and driver.destroyed == ["green"]


def test_no_green_contexts_means_the_whole_gpu(fake_driver: Any):
    fake_driver(FakeDriver(fail="cuGreenCtxCreate"))
    green, context, report = target.partition(target.CMP, 0)
    assert (green, context, report.granted) == (None, None, None)
    assert "cuGreenCtxCreate is not supported" in report.reason


def test_a_second_thread_that_cannot_use_it_gives_it_up(fake_driver: Any):
    driver = FakeDriver(sms=132, partition_sms=72)
    fake_driver(driver)
    real_alloc = driver.cuMemAlloc

    def alloc_in_main_thread_only(size: int) -> tuple:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("CUDA_ERROR_CONTEXT_ALREADY_IN_USE")
        return real_alloc(size)

    driver.cuMemAlloc = alloc_in_main_thread_only  # type: ignore[method-assign]
    _, context, report = target.partition(target.CMP, 0)
    assert context is None and "ALREADY_IN_USE" in report.reason and driver.destroyed == ["green"]


def test_the_partition_can_be_turned_off(fake_driver: Any, monkeypatch: pytest.MonkeyPatch):
    driver = fake_driver(FakeDriver())
    monkeypatch.setenv(target.PARTITION_VARIABLE, "off")
    _, context, report = target.partition(target.CMP, 0)
    assert context is None and report.reason == "CMPCHAT_CMP_PARTITION=off" and driver.calls == []


def test_the_sm_id_kernel_assembles_for_sm_70_and_sm_90():
    """The self-test's hand-written PTX, with CUDA 12's ptxas for the CMP's sm_70 and, where installed, CUDA 13's
    for the H200's sm_90 (what the driver's JIT does with it there)."""
    from cmpchat.devtools.ptx_check import find_ptxas

    try:
        assemblers = [(find_ptxas(), "sm_70")]
    except FileNotFoundError:
        pytest.skip("no ptxas from the nvidia-cuda-nvcc-cu12 wheel")
    if shutil.which("ptxas") and "release 13" in subprocess.run(["ptxas", "--version"], capture_output=True,
                                                                  text=True).stdout:  # fmt: skip
        assemblers.append((Path(shutil.which("ptxas") or "ptxas"), "sm_90"))
    source = Path(os.environ.get("TMPDIR", "/tmp")) / f"cmpchat-sm-ids-{os.getpid()}.ptx"
    source.write_bytes(target.SM_IDS_PTX.rstrip(b"\x00"))
    try:
        for ptxas, arch in assemblers:
            finished = subprocess.run([str(ptxas), f"-arch={arch}", str(source), "-o", os.devnull],
                                      capture_output=True, text=True)  # fmt: skip
            assert finished.returncode == 0, (arch, finished.stderr)
    finally:
        source.unlink()


# --- a process on the CMP code path (no simulator, no GPU) -----------------------------------------------------

CHILD = r"""
import json, sys
from cuda import pathfinder
from numba.core import config
from cmpchat.cudart import target
from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels
from cmpchat.devtools.ptx_check import compile_ptx
from cmpchat.kernels.device_table import SM_70, DeviceSpec, default_tuning

imported, failed = import_kernel_modules()
assert not failed, failed
specs = registered_kernels()
caches = {type(s.dispatcher._cache).__name__: str(s.dispatcher._cache._cache_path) for s in specs[:1]}
early = [s for s in specs if s.early_launch]
spec = early[0] if early else specs[0]
ptx = compile_ptx(spec, spec.signatures[0], cc=(9, 0))  # what the device's cc would ask for: the profile's wins
sys.path.insert(0, "cuda")
import cmp_path_check
from numba import cuda
probe_ptx, _ = cuda.compile_ptx(cmp_path_check._sm_probe_kernel().py_func,
                                "void(uint32[::1], int32[::1], float32[::1], uint32)", cc=(7, 0))
loaded = pathfinder.load_nvidia_dynamic_lib("nvvm")
print(json.dumps({
    "status": target.status(),
    "force_cc": list(config.FORCE_CUDA_CC),
    "cache_dir": config.CACHE_DIR,
    "caches": caches,
    "ptx": cmp_path_check._ptx_facts(ptx),
    "early_kernel": bool(early),
    "probe_ptx": cmp_path_check._ptx_facts(probe_ptx),
    "nvvm_loaded": [loaded.abs_path, loaded.found_via],
    "tuning": default_tuning(DeviceSpec((9, 0), 132)) is SM_70,
}))
"""


def cuda12_nvvm_or_skip() -> Path:
    try:
        wheel = importlib.metadata.distribution(target.NVCC_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the nvidia-cuda-nvcc-cu12 wheel (numba-cuda[cu12])")
    folder = Path(str(wheel.locate_file("nvidia/cuda_nvcc")))
    if not (folder / target.LIBNVVM).is_file():
        pytest.skip("the nvidia-cuda-nvcc-cu12 wheel has no libnvvm")
    return folder


def test_a_cmp_process_compiles_compute_70_ptx_with_cuda12_nvvm_into_its_own_cache(tmp_path: Path):
    wheel = cuda12_nvvm_or_skip()
    nvvm = tmp_path / "cuda12"  # as gpu_run.sh unpacks it: a folder of its own, named by the variable
    for relative in (target.LIBNVVM, target.LIBDEVICE):
        (nvvm / relative).parent.mkdir(parents=True)
        (nvvm / relative).symlink_to(wheel / relative)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "CMPCHAT_TUNING")}
    env |= {"CMPCHAT_PROFILE": "cmp", target.NVVM_VARIABLE: str(nvvm), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    finished = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    facts = json.loads(finished.stdout.strip().splitlines()[-1])
    cache = tmp_path / "numba" / target.CACHE_NAME
    assert facts["status"]["profile"] == "cmp" and facts["status"]["nvvm"] == str((nvvm / target.LIBNVVM).resolve())
    assert facts["status"]["tuning"] == "sm_70" and facts["status"]["early_launch"] is False
    assert facts["force_cc"] == [7, 0] and facts["cache_dir"] == str(cache)
    assert all(path.startswith(str(cache)) for path in facts["caches"].values()), facts["caches"]
    for ptx in (facts["ptx"], facts["probe_ptx"]):
        assert ptx["ptx_target"] == "sm_70" and ptx["nvvm_release"].startswith("Cuda compilation tools, release 12.")
    assert facts["ptx"]["griddepcontrol"] == 0  # compute_70: NVVM reflects __CUDA_ARCH 700, no early-launch waits
    assert facts["nvvm_loaded"][1] == "was-already-loaded-from-elsewhere"
    assert facts["tuning"]


def test_a_cmp_process_without_cuda12_nvvm_says_so(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "CMPCHAT_TUNING")}
    env |= {"CMPCHAT_PROFILE": "cmp", target.NVVM_VARIABLE: str(tmp_path / "nothing")}
    script = (
        "from cmpchat.cudart import target\n"
        "target.nvvm_candidates = lambda environ=None: [target.Path(environ_dir)]\n"
        "try:\n    target.activate()\nexcept target.CmpchatError as error:\n    print('refused:', error)\n"
    ).replace("environ_dir", repr(str(tmp_path / "nothing")))
    finished = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "refused: the CMP code path needs CUDA 12's NVVM" in finished.stdout


def test_kernels_defined_before_the_profile_move_to_its_cache(tmp_path: Path):
    """`--profile cmp` applies when the command runs; a kernel module imported before then chose its cache folder
    already, and is moved to the profile's."""
    cuda12_nvvm_or_skip()
    script = (
        "import json\n"
        "from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels\n"
        "from cmpchat.cudart import target\n"
        "import_kernel_modules()\n"
        "spec = registered_kernels()[0]\n"
        "before = str(spec.dispatcher._cache._cache_path)\n"
        "target.activate('cmp')\n"
        "print(json.dumps([before, str(spec.dispatcher._cache._cache_path)]))\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "CMPCHAT_TUNING", "CMPCHAT_PROFILE")
    }
    env |= {"NUMBA_CACHE_DIR": str(tmp_path)}
    finished = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    before, after = json.loads(finished.stdout.strip().splitlines()[-1])
    assert target.CACHE_NAME not in before and after.startswith(str(tmp_path / target.CACHE_NAME))
