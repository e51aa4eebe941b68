"""The doctor's probes on a GPU (`pytest -m gpu tests/doctor`): each chain kernel stores what the simulator's
reference says (the inline PTX computes the right thing, and is not dead), the quick probe gives positive,
plausible figures on GPU 0, the tensor-core probe runs only when asked for and its SASS holds the HMMA the
checks exempt by name; and on an H200 nothing is judged throttled."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.kernels.test_throughput_probes_sim import (
    DP4A_INPUTS,
    FFMA_INPUTS,
    FUSED_CASE,
    GRID,
    HFMA2_INPUTS,
    THREADS,
    dp4a_chains_reference,
    ffma_chains_reference,
    fp16_pair,
    hfma2_chains_reference,
)

pytestmark = pytest.mark.gpu


def run_chains(dispatcher, inputs: np.ndarray, iterations: int, out_dtype) -> np.ndarray:
    from numba import cuda

    out = cuda.device_array(THREADS, out_dtype)
    dispatcher[GRID](cuda.to_device(inputs), np.int32(iterations), out)
    return out.copy_to_host()


def test_the_chain_kernels_compute_their_references():
    from cmpchat.kernels.throughput_probes import dp4a_chains, ffma_chains, hfma2_chains

    for iterations in (0, 1, 3, 37):
        np.testing.assert_array_equal(
            run_chains(dp4a_chains, DP4A_INPUTS, iterations, np.int32), dp4a_chains_reference(DP4A_INPUTS, iterations)
        )
        np.testing.assert_array_equal(
            run_chains(ffma_chains, FFMA_INPUTS, min(iterations, 4), np.float32),
            ffma_chains_reference(FFMA_INPUTS, min(iterations, 4)),
        )  # (acc × 2 − 1 leaves exact fp32 after a few steps)
    for iterations in (0, 1, 3):
        np.testing.assert_array_equal(
            run_chains(hfma2_chains, HFMA2_INPUTS, iterations, np.float32),
            hfma2_chains_reference(HFMA2_INPUTS, iterations),
        )


def test_fma_f16x2_is_fused_per_lane_on_the_gpu():
    from numba import cuda

    from cmpchat.cudart.intrinsics import fma_f16x2

    @cuda.jit
    def run(a, b, c, out):
        out[0] = fma_f16x2(a[0], b[0], c[0])

    out = cuda.device_array(1, np.uint32)
    run[1, 1](*(cuda.to_device(np.array([word], np.uint32)) for word in FUSED_CASE), out)
    assert out.copy_to_host()[0] == fp16_pair(2**-20, 0.5)


def test_the_mma_chains_add_16_products_per_step():
    from numba import cuda

    from cmpchat.kernels.tensor_core_probe import FP16_ONES, mma_chains

    inputs = cuda.to_device(np.array([FP16_ONES, fp16_pair(0.5, 0.5)], np.uint32))
    out = cuda.device_array(64, np.float32)
    mma_chains[2, 32](inputs, np.int32(5), out)
    # every accumulator gains k = 16 products of 1 × 0.5 per step; 4 chains × 8 accumulators per thread
    np.testing.assert_array_equal(out.copy_to_host(), 32 * 5 * 16 * 0.5)


def test_the_tensor_core_probe_is_the_exempt_kernel_with_hmma_in_its_sass():
    from cmpchat.cudart.compile import KERNELS
    from cmpchat.devtools.sass_check import check_kernel, disassembler
    from cmpchat.kernels import tensor_core_probe

    (spec,) = [spec for spec in KERNELS if spec.dispatcher is tensor_core_probe.mma_chains]
    report = check_kernel(spec, spec.signatures[0], disassembler())
    assert report.tensor_core_opcodes == ["HMMA"] and report.problems == []


@pytest.fixture(scope="module")
def quick_gpu0():
    from cmpchat.doctor.probe import QUICK, measure_gpu

    return measure_gpu(0, [0], sizes=QUICK)


def test_the_quick_probe_gives_plausible_figures(quick_gpu0):
    m = quick_gpu0
    assert m.read_bytes_per_s > 100e9 and m.copy_bytes_per_s > 100e9
    assert m.dp4a_ops_per_s > 1e12 and m.hfma2_flops_per_s > 1e12 and m.ffma_flops_per_s > 1e12
    assert m.host_to_device_bytes_per_s > 0.1e9 and m.device_to_host_bytes_per_s > 0.1e9
    assert m.peer_access == {}
    assert m.tensor_core_flops_per_s is None


def test_the_tensor_core_probe_runs_only_with_the_flag(monkeypatch: pytest.MonkeyPatch):
    from cmpchat.doctor.probe import QUICK, measure_gpu
    from cmpchat.kernels import tensor_core_probe

    real_rate = tensor_core_probe.mma_rate
    calls: list[tuple[float, int]] = []

    def counted_rate(seconds_per_launch: float, repeats: int) -> float:
        calls.append((seconds_per_launch, repeats))
        return real_rate(seconds_per_launch, repeats)

    monkeypatch.setattr(tensor_core_probe, "mma_rate", counted_rate)
    without = measure_gpu(0, [0], sizes=QUICK)
    assert calls == [] and without.tensor_core_flops_per_s is None
    with_flag = measure_gpu(0, [0], tensor_cores=True, sizes=QUICK)
    assert len(calls) == 1 and with_flag.tensor_core_flops_per_s is not None
    assert with_flag.tensor_core_flops_per_s > 1e12


def test_an_h200_is_judged_throttled_nowhere():
    from cmpchat.doctor.probe import QUICK, measure_gpu
    from cmpchat.doctor.verdict import judge
    from tests.doctor.conftest import throttled_paths

    m = measure_gpu(0, [0], tensor_cores=True, sizes=QUICK)
    if "H200" not in m.name:
        pytest.skip(f"the thresholds' check is for an H200, this is a {m.name}")
    findings = judge([m])
    assert throttled_paths(findings, 0) == set(), [f.text for f in findings]


def test_the_command_prints_json(capsys):
    from cmpchat.cli import main

    assert main(["doctor", "--quick", "--gpu", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (gpu,) = report["gpus"]
    assert gpu["index"] == 0 and gpu["read_bytes_per_s"] > 100e9 and gpu["tensor_core_flops_per_s"] is None
    assert any(f["path"] == "summary" for f in report["findings"])
