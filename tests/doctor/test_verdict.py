"""The doctor's verdict on injected measurements: a CMP 100-210 is throttled on tensor cores and the host link
and nowhere cmpchat's kernels depend on; an H200 is throttled nowhere; each rule's threshold is half the
lowest healthy ratio it names."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cmpchat.doctor.verdict import (
    DP4A,
    FFMA,
    HFMA2,
    HOST_LINK,
    MEMORY_READ,
    P2P,
    RATIO_RULES,
    TENSOR_CORES,
    THROTTLE_MARGIN,
    Finding,
    judge,
)
from tests.doctor.conftest import cmp_100_210, h200, throttled_paths


def finding(findings: list[Finding], path: str, gpu: int = 0) -> Finding:
    (match,) = [f for f in findings if f.path == path and f.gpus == (gpu,)]
    return match


def test_a_cmp_is_throttled_on_tensor_cores_and_the_host_link(two_cmps):
    findings = judge(two_cmps)
    for gpu in (0, 1):
        assert throttled_paths(findings, gpu) == {TENSOR_CORES, HOST_LINK}
        assert finding(findings, "summary", gpu).throttled
    tensor = finding(findings, TENSOR_CORES).text
    assert "5.5 TFLOPS, 1/4 of FP16 FMA" in tensor and "healthy ≥ 4×" in tensor and "never uses them" in tensor
    link = finding(findings, HOST_LINK).text
    assert "looks like PCIe Gen1 x1" in link and "loading 9B Q8_0 (9.5 GB) takes ~41 s" in link
    assert "one 8 KiB hidden vector per token (~37 µs each way), fine" in link
    summary = finding(findings, "summary").text
    assert "harmless: cmpchat never uses them" in summary and "model loading is slow" in summary


def test_a_cmp_runs_cmpchat_paths_at_full_speed(two_cmps):
    findings = judge(two_cmps)
    assert "DP4A 34.4 TOPS, 3.4× FP32 FMA (healthy ≥ 2×" in finding(findings, DP4A).text
    assert "every quantised matmul runs on it" in finding(findings, DP4A).text
    assert "2.2× FP32 FMA" in finding(findings, HFMA2).text
    assert "12 FLOP per byte read" in finding(findings, FFMA).text
    read = finding(findings, MEMORY_READ)
    assert read.throttled is False
    assert "818 GB/s" in read.text and "9B ≤ 97 tok/s, 27B ≤ 30 tok/s" in read.text
    for path in (DP4A, HFMA2, FFMA):
        assert finding(findings, path).throttled is False


def test_cmps_have_no_p2p_and_cmpchat_does_not_need_it(two_cmps):
    (p2p,) = [f for f in judge(two_cmps) if f.path == P2P]
    assert p2p.gpus == (0, 1) and p2p.throttled is None
    assert (
        p2p.text == "no P2P between GPU 0 and 1: activations go through pinned host memory (what cmpchat does anyway)"
    )


def test_an_h200_is_throttled_nowhere(two_h200s):
    findings = judge(two_h200s)
    for gpu in (0, 1):
        assert throttled_paths(findings, gpu) == set()
        assert finding(findings, "summary", gpu).text == "summary: nothing looks throttled"
    assert "looks like PCIe Gen5 x16" in finding(findings, HOST_LINK).text
    assert "as expected (a healthy H200: 4.57 TB/s)" in finding(findings, MEMORY_READ).text
    (p2p,) = [f for f in findings if f.path == P2P]
    assert p2p.text.startswith("P2P possible between GPU 0 and 1; cmpchat does not need it")


def test_tensor_cores_are_not_judged_unless_measured():
    findings = judge([dataclasses.replace(h200(), tensor_core_flops_per_s=None)])
    tensor = finding(findings, TENSOR_CORES)
    assert tensor.throttled is None and "--tensor-cores" in tensor.text
    assert [f.path for f in findings if f.path == P2P and f.text == "P2P: only one GPU"] == [P2P]


@pytest.mark.parametrize("rule", RATIO_RULES, ids=lambda rule: rule.path)
def test_a_ratio_path_is_throttled_below_half_the_healthy_ratio(rule):
    field = {DP4A: "dp4a_ops_per_s", HFMA2: "hfma2_flops_per_s", TENSOR_CORES: "tensor_core_flops_per_s"}[rule.path]
    base = h200()
    threshold = rule.healthy / THROTTLE_MARGIN * rule.reference_rate(base)
    at_threshold = finding(judge([dataclasses.replace(base, **{field: threshold})]), rule.path)
    below = finding(judge([dataclasses.replace(base, **{field: 0.99 * threshold})]), rule.path)
    assert (at_threshold.throttled, below.throttled) == (False, True)
    assert f"healthy ≥ {rule.healthy:g}×" in below.text


def test_a_throttled_engine_path_is_named_with_its_cost():
    pascal_like = dataclasses.replace(cmp_100_210(), hfma2_flops_per_s=10e12 / 64)  # fp16 at 1/64, GP102-style
    findings = judge([pascal_like])
    assert throttled_paths(findings, 0) == {HFMA2, HOST_LINK}
    assert "1/64 of FP32 FMA" in finding(findings, HFMA2).text
    assert "FP16 FMA (HFMA2) (no effect on cmpchat, which computes in fp32)" in finding(findings, "summary").text
    ffma = cmp_100_210().ffma_flops_per_s
    assert ffma is not None
    slow_dp4a = dataclasses.replace(cmp_100_210(), dp4a_ops_per_s=ffma / 4)
    assert "DP4A (prompt processing is slower)" in finding(judge([slow_dp4a]), "summary").text
    # the tensor cores are judged against the (throttled) HFMA2 they would replace: 5.5 T is 35× that
    assert finding(findings, TENSOR_CORES).throttled is False


def test_fp32_is_judged_per_byte_of_memory_read():
    slow_fp32 = dataclasses.replace(cmp_100_210(), ffma_flops_per_s=3e12)  # 3.7 FLOP/byte < 10 / 2
    assert finding(judge([slow_fp32]), FFMA).throttled


def test_read_bandwidth_is_judged_only_for_known_cards():
    lowered = dataclasses.replace(cmp_100_210(), read_bytes_per_s=500e9)
    read = finding(judge([lowered]), MEMORY_READ)
    assert read.throttled and "61% of a healthy CMP 100-210's 818 GB/s" in read.text
    unknown = dataclasses.replace(lowered, name="NVIDIA Graphics Device")
    assert finding(judge([unknown]), MEMORY_READ).throttled is None


@pytest.mark.parametrize(
    ("gigabytes_per_s", "looks_like", "throttled"),
    [
        (0.2, "Gen1 x1", True),
        (0.45, "Gen2 x1", True),
        (0.9, "Gen3 x1", True),
        (3.3, "Gen3 x4", False),
        (12.5, "Gen3 x16", False),
        (26, "Gen4 x16", False),
        (100, "faster than PCIe Gen5 x16", False),
    ],
)
def test_the_host_link_is_matched_to_a_pcie_link(gigabytes_per_s, looks_like, throttled):
    bandwidth = gigabytes_per_s * 1e9
    m = dataclasses.replace(h200(), host_to_device_bytes_per_s=bandwidth, device_to_host_bytes_per_s=bandwidth)
    link = finding(judge([m]), HOST_LINK)
    assert looks_like in link.text
    assert link.throttled is throttled


def test_p2p_is_reported_per_pair_when_pairs_differ():
    gpus = [h200(0, peers=(1, 2)), h200(1, peers=(0, 2)), dataclasses.replace(h200(2), peer_access={0: False, 1: True})]
    texts = [f.text for f in judge(gpus) if f.path == P2P]
    assert texts[0].startswith("P2P possible between GPU 0 and 1")
    assert texts[1].startswith("no P2P between GPU 0 and 2")
    assert texts[2].startswith("P2P possible between GPU 1 and 2")
    assert len(texts) == 3


def test_nothing_measured_judges_nothing():
    unmeasured: dict[str, Any] = {f.name: None for f in dataclasses.fields(h200()) if f.name.endswith("_per_s")}
    bare = dataclasses.replace(h200(), **unmeasured)
    findings = judge([bare])
    assert all(f.throttled is None for f in findings if f.path != "summary")
    assert all("not measured" in f.text for f in findings if f.path not in ("summary", P2P))
