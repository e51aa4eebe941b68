"""The GPU machine's scripts for the CMP code path (issue 34) on the CPU: `cuda/gpu_run.py --profile cmp`'s choices,
`cuda/cmp_path_check.py`'s pass marks and tables, and `cuda/fetch_wheels.sh`'s CMP bundle list."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "cuda" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture(scope="module")
def gpu_run() -> ModuleType:
    return load_script("gpu_run")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script("cmp_path_check")


def test_the_cmp_tier_leaves_out_only_what_names_its_reason(gpu_run: ModuleType):
    native, cmp = gpu_run.gpu_test_files(), gpu_run.gpu_test_files("cmp")
    assert set(native) - set(cmp) == set(gpu_run.CMP_SKIPPED_FILES)
    assert "tests/kernels/test_ptx_sass.py" in cmp and "tests/backends/test_cuda_backend_gpu.py" in cmp
    args = gpu_run.profile_pytest_args("cmp")
    assert args == [
        "-p",
        "tests.cmp_profile_plugin",
        *(a for test in gpu_run.CMP_DESELECTED for a in ("--deselect", test)),
    ]
    assert (REPO / "tests" / "cmp_profile_plugin.py").is_file()
    assert gpu_run.profile_pytest_args("native") == []
    for test, why in gpu_run.CMP_DESELECTED.items():  # each still names a test that exists
        path, function = test.split("::")
        assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.MULTILINE), test
        assert why


def test_the_cmp_benchmarks_hold_27b_on_three_16_gb_stages(gpu_run: ModuleType, tmp_path: Path):
    decode = gpu_run.cmp_benchmarks(tmp_path, ["9B", "27B"], "bench", [])
    assert decode["decode_27B_3_stages"][4:9] == ["decode", "27B", "--gpus", "0,0,0", "--folder"]
    assert "--gpus" not in decode["decode_9B"] and "--llama-bench" not in " ".join(decode["decode_9B"])
    assert decode["decode_9B"][-1] == str(tmp_path / "bench_decode_9B_cmp.json") and "gemv" in decode
    prefill = gpu_run.cmp_benchmarks(tmp_path, ["9B"], "prefill", [297, 1160])
    assert prefill["prefill_9B"][4:9] == ["prefill", "9B", "--tokens", "297", "1160"] and "gemm" in prefill


def test_the_cmp_profile_refuses_the_modes_it_cannot_run(gpu_run: ModuleType, tmp_path: Path):
    with pytest.raises(SystemExit):
        gpu_run.main(["--mode", "sweep", "--profile", "cmp", "--results", str(tmp_path)])
    assert set(gpu_run.CMP_MODES) == {"quick", "full", "bench", "prefill", "cmpcheck"}


def runs(rng: np.random.Generator, noise: dict[str, float], positions: int = 65, vocab: int = 300) -> dict:
    native = rng.normal(0, 4, (positions, vocab)).astype(np.float32)
    native[:, 7] += 30  # a clear winner everywhere
    long = rng.normal(0, 4, vocab).astype(np.float32)
    out = {"native": {"decode": native, "prompt_last": long}}
    for name, scale in noise.items():
        out[name] = {
            "decode": native + rng.normal(0, scale, native.shape).astype(np.float32),
            "prompt_last": long + rng.normal(0, scale, long.shape).astype(np.float32),
        }
    return out


def test_the_oracle_is_held_to_the_gpu_tiers_bound(check: ModuleType):
    rng = np.random.default_rng(0)
    good = check.judge("oracle", runs(rng, {"cmp": 1e-5}), oracle=True)
    assert good["passed"] and good["bounds"] == {"median": 1e-3, "max": 1e-3}
    assert good["greedy"]["clear_positions"] == good["greedy"]["equal_where_clear"] == 65
    bad = check.judge("oracle", runs(rng, {"cmp": 1e-2}), oracle=True)
    assert not bad["passed"]


def test_the_9b_bound_is_twice_what_the_control_moves(check: ModuleType):
    rng = np.random.default_rng(1)
    within = check.judge("9B", runs(rng, {"cmp": 0.02, "control": 0.02}), oracle=False)
    control = within["control"]
    assert within["bounds"]["median"] == pytest.approx(2 * control["median"] + 1e-4)
    assert within["bounds"]["max"] == pytest.approx(2 * max(control["max"], control["prompt_last"]) + 1e-3)
    assert within["passed"], within
    beyond = check.judge("9B", runs(rng, {"cmp": 0.5, "control": 0.02}), oracle=False)
    assert not beyond["passed"]


def test_greedy_tokens_must_agree_only_where_the_margin_is_clear(check: ModuleType):
    rng = np.random.default_rng(2)
    data = runs(rng, {"cmp": 0.0})
    native = data["native"]["decode"]
    native[3, 9] = native[3, 7] - 1e-4  # position 3: a near tie, and the CMP run flips it
    flipped = native.copy()
    flipped[3, 9], flipped[3, 7] = native[3, 7], native[3, 9]
    data["cmp"]["decode"] = flipped
    result = check.judge("oracle", data, oracle=True)
    assert result["greedy"]["clear_positions"] == 64 and result["greedy"]["equal_everywhere"] == 64
    assert result["passed"]  # within 1e-3 of the range too: the flip is where the margin is not clear


def facts(**changes: object) -> dict:
    base: dict = {
        "probe_kernel_ptx": {"ptx_target": "sm_70", "nvvm_release": "Cuda compilation tools, release 12.9, V12.9.86"},
        "early_launch_kernel_ptx": {"griddepcontrol": 0},
        "early_launch": {
            "row_early_launch": False,
            "launches_early": False,
            "launcher_allows": False,
            "launched_early_here_on_gpu": False,
        },  # fmt: skip
        "gpu": {"engine_multiprocessors": 68},
        "code_path": {"partitions": {"0": {"granted": 72}}},
        "sms_used": {"numba": 72, "raw": 72, "graph": 72},
    }
    return base | changes


def test_the_probe_checks_every_fact_of_the_code_path(check: ModuleType):
    assert check.probe_problems(facts(), "cmp") == []
    assert check.probe_problems(facts(probe_kernel_ptx={"ptx_target": "sm_90", "nvvm_release": "release 13.0"}),
                                "cmp")  # fmt: skip
    assert check.probe_problems(facts(early_launch={"launched_early_here_on_gpu": True}), "cmp")
    assert check.probe_problems(facts(early_launch_kernel_ptx={"griddepcontrol": 2}), "cmp")
    assert check.probe_problems(facts(gpu={"engine_multiprocessors": 132}), "cmp")
    assert check.probe_problems(facts(sms_used={"numba": 72, "raw": 132, "graph": 72}), "cmp")
    assert check.probe_problems(facts(sms_used={"raw": "blocks missing: [1]"}), "native")
    assert check.probe_problems(facts(gpu={"engine_multiprocessors": 132}, probe_kernel_ptx={}), "native") == []


def test_children_get_only_their_own_profile(check: ModuleType, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NUMBA_FORCE_CUDA_CC", "7.0")
    monkeypatch.setenv("CMPCHAT_TUNING", "sm_70")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    native = check.clean_environment(check.PROFILES["native"])
    assert not {"NUMBA_FORCE_CUDA_CC", "CMPCHAT_TUNING", "NUMBA_ENABLE_CUDASIM", "CMPCHAT_PROFILE"} & set(native)
    assert check.clean_environment(check.PROFILES["cmp"])["CMPCHAT_PROFILE"] == "cmp"
    assert check.clean_environment(check.PROFILES["control"])["CMPCHAT_SM_COUNT"] == "68"


def test_bench_figures_side_by_side(check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    def decode(gpu: str, tok_s: float) -> list[dict]:
        run = {"context": 0, "batch": 1, "tok_s": tok_s, "ratio_of_limit": 0.8, "cmp_projection_tok_s": 77.0,
               "pipeline_projection_tok_s": None}  # fmt: skip
        return [{"model": "m.gguf", "shape": "9B", "gpu": gpu, "read_bandwidth_GBps": 4500.0, "runs": [run]}]

    (tmp_path / "native.json").write_text(json.dumps(decode("NVIDIA H200", 400.0)))
    (tmp_path / "cmp.json").write_text(json.dumps(decode("NVIDIA H200 (CMP 100-210 code path)", 300.0)))
    assert check.side_by_side(tmp_path / "native.json", tmp_path / "cmp.json") == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (CMP 100-210 code path)" in out and "400.0" in out and "300.0" in out and "77.0" in out


def test_the_cmp_bundle_packs_pinned_wheels_and_the_cpu_tiers_nvvm():
    script = (REPO / "cuda" / "fetch_wheels.sh").read_text()
    pins = {
        line.split("==")[0].strip().replace("-", "_") for line in re.findall(r"^\s+([\w.-]+==[\w.]+)", script, re.M)
    }
    bundle = re.search(r"^CMP_WHEELS=\((.*)\)", script, re.MULTILINE)
    assert bundle is not None
    assert set(bundle.group(1).split()) <= pins
    nvcc = re.search(r"^NVCC_CU12=nvidia-cuda-nvcc-cu12==([\d.]+)", script, re.MULTILINE)
    assert nvcc is not None
    try:
        assert nvcc.group(1) == importlib.metadata.version("nvidia-cuda-nvcc-cu12")  # the PTX check's NVVM
    except importlib.metadata.PackageNotFoundError:
        pass
    gpu_run_sh = (REPO / "cuda" / "gpu_run.sh").read_text()
    assert ".whl-cmp/cuda12-nvvm-" in gpu_run_sh and "CMPCHAT_CUDA12_NVVM" in gpu_run_sh


def test_the_report_names_each_mark(check: ModuleType):
    rng = np.random.default_rng(3)
    models = [
        check.judge("oracle", runs(rng, {"cmp": 1e-5, "control": 1e-5}), oracle=True),
        check.judge("9B", runs(rng, {"cmp": 0.5, "control": 0.02}), oracle=False),
    ]
    child = {
        "returncode": 0,
        "seconds": 1.0,
        "read_bandwidth_GBps": 3900.0,
        "sms_used": {"raw": 72},
        "probe_problems": [],
    }
    report = {"steps": 64, "children": {"native": child, "cmp": child}, "models": models, "passed": False}
    lines = check.format_report(report)
    assert lines[-1] == "RESULT: FAIL"
    assert any(line.startswith("  oracle:") for line in lines) and any(line.startswith("  9B:") for line in lines)
    assert sum(line.endswith("PASS") for line in lines) == 1 and sum(line.endswith("FAIL") for line in lines) == 2
