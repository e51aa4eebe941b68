"""The doctor's verdict: from measurements to plain-English findings, which paths look throttled and which
ones cmpchat uses. Pure functions of `GpuMeasurements`, so any card's figures can be judged without it.

Compute paths are judged by their ratio to another path of the same GPU, so clocks and SM counts cancel and
no table of cards is needed. Each rule names the lowest ratio healthy GPUs show; a path counts as throttled
below half of that, so a probe that misses a peak by tens of percent raises no alarm and a 64× throttle
cannot hide. The host link is judged against PCIe figures; the read bandwidth against the figure measured
on a healthy card of the same model, when the model is known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cmpchat.doctor.measurements import GpuMeasurements
from cmpchat.model.builder import MODEL_SHAPES, tensor_specs
from cmpchat.model.quant import Q8_0_BLOCK, Q8_0_BLOCK_BYTES

THROTTLE_MARGIN = 2.0
"""A path is throttled when its ratio is more than this many times below the healthy minimum."""

KNOWN_READ_BYTES_PER_S = {"CMP 100-210": 818e9, "H200": 4.57e12}
"""Streaming read of healthy cards, by a substring of the device name: the CMP's from docs/hardware.md
("The CMP 100-210"), the H200's as this probe measures it (an earlier 4.11 TB/s predates timing the read kernel
from a CUDA graph)."""
KNOWN_READ_SHORTFALL = 0.8
"""Read bandwidth below this fraction of a known card's figure is flagged: lowered memory clocks are a
common mining tweak, and decode slows in proportion."""

PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9}
"""Raw bandwidth of one PCIe lane, each way, by generation (after 8b/10b or 128b/130b encoding)."""
PCIE_WIDTHS = (16, 8, 4, 1)
HEALTHY_LINK_BYTES_PER_S = 4 * PCIE_LANE_BYTES_PER_S[3]
"""GPU slots of the last decade carry at least PCIe Gen3 x4; mining risers and CMP cards run x1."""

FFMA_HEALTHY_FLOPS_PER_BYTE = 10.0
"""FP32 FMA flops per byte of streaming read, the lowest of healthy GPUs (V100 17, H200 14, CMP 100-210 12)."""

MEMORY_READ, DP4A, HFMA2, FFMA, TENSOR_CORES = "memory read", "DP4A", "FP16 FMA (HFMA2)", "FP32 FMA", "tensor cores"
HOST_LINK, P2P = "host link", "P2P"

ENGINE_USE = {
    MEMORY_READ: "decode reads every weight once per token",
    DP4A: "every quantised matmul runs on it",
    HFMA2: "cmpchat does not rely on it: fp16 caches are widened and computed in fp32",
    FFMA: "norms, softmax and accumulations run on it",
    TENSOR_CORES: "cmpchat never uses them",
    HOST_LINK: "cmpchat loads models over it",
}
WHEN_THROTTLED = {
    MEMORY_READ: "decode is slower in proportion",
    DP4A: "prompt processing is slower",
    HFMA2: "no effect on cmpchat, which computes in fp32",
    FFMA: "norms and accumulations are slower",
    TENSOR_CORES: "harmless: cmpchat never uses them",
    HOST_LINK: "model loading is slow; decode sends only one hidden vector per token across it",
}


@dataclass(frozen=True)
class Finding:
    gpus: tuple[int, ...]
    """The GPU judged, or the GPUs of a P2P finding."""
    path: str
    throttled: bool | None
    """None when not judged: not measured, nothing to compare with, or information only."""
    text: str


@dataclass(frozen=True)
class RatioRule:
    """`path` judged by its rate over `reference`'s on the same GPU."""

    path: str
    reference: str
    rate: Callable[[GpuMeasurements], float | None]
    reference_rate: Callable[[GpuMeasurements], float | None]
    healthy: float
    """The lowest ratio of healthy GPUs."""
    examples: str
    unit: str


RATIO_RULES = (
    # One dp4a issues per FP32 FMA on Volta (4× in ops), one per two on Hopper (2×).
    RatioRule(DP4A, FFMA, lambda m: m.dp4a_ops_per_s, lambda m: m.ffma_flops_per_s, 2.0, "Volta 4×", "TOPS"),
    # fp16 pairs issue like FP32 FMAs on Volta and Hopper (2×); GeForce Ampere has 1×.
    RatioRule(
        HFMA2, FFMA, lambda m: m.hfma2_flops_per_s, lambda m: m.ffma_flops_per_s, 1.0, "Volta and Hopper 2×", "TFLOPS"
    ),
    # Dense fp16 tensor-core peak over HFMA2: V100 125/31 = 4×, A100 312/78 = 4×, H100 989/134 = 7×.
    RatioRule(
        TENSOR_CORES, HFMA2, lambda m: m.tensor_core_flops_per_s, lambda m: m.hfma2_flops_per_s, 4.0, "H100 7×",
        "TFLOPS",
    ),
)  # fmt: skip


def _q8_0_model_bytes(name: str) -> tuple[int, int]:
    """(file bytes, bytes one decode step reads) of a released Qwen3.5 size in Q8_0, as llama.cpp stores it."""
    shape = MODEL_SHAPES[name]
    file_bytes = step_bytes = 0
    for spec in tensor_specs(shape):
        elements = int(np.prod(spec.shape))
        nbytes = elements // Q8_0_BLOCK * Q8_0_BLOCK_BYTES if spec.role == "matrix" else 4 * elements
        file_bytes += nbytes
        if spec.name != "token_embd.weight" or shape.tied_embeddings:  # a lookup reads one embedding row
            step_bytes += nbytes
    return file_bytes, step_bytes


MODEL_BYTES = {name: _q8_0_model_bytes(name) for name in ("9B", "27B")}
HIDDEN_VECTOR_BYTES = 2 * MODEL_SHAPES["9B"].hidden_size
"""What pipelining 9B over GPUs sends across each boundary per token: one fp16 hidden vector."""


def judge(measurements: Sequence[GpuMeasurements]) -> list[Finding]:
    """Findings for each GPU in order (its paths, then a summary), then P2P between the GPUs."""
    findings: list[Finding] = []
    for m in measurements:
        own = [_judge_read(m), _judge_ffma(m), *(_judge_ratio(rule, m) for rule in RATIO_RULES), _judge_link(m)]
        findings += [*own, _summary(m.index, own)]
    return findings + _judge_peers(measurements)


def _judge_ratio(rule: RatioRule, m: GpuMeasurements) -> Finding:
    rate, reference, use = rule.rate(m), rule.reference_rate(m), ENGINE_USE[rule.path]
    if rate is None:
        hint = " (run with --tensor-cores)" if rule.path == TENSOR_CORES else ""
        return Finding((m.index,), rule.path, None, f"{rule.path}: not measured{hint}; {use}")
    measured = f"{rule.path} {rate / 1e12:.1f} {rule.unit}"
    if not reference:
        return Finding((m.index,), rule.path, None, f"{measured} ({rule.reference} not measured); {use}")
    ratio = rate / reference
    throttled = ratio < rule.healthy / THROTTLE_MARGIN
    text = (
        f"{measured}, {_times(ratio)} {rule.reference} (healthy ≥ {rule.healthy:g}×, {rule.examples})"
        f" — {_status(throttled)}; {use}"
    )
    return Finding((m.index,), rule.path, throttled, text)


def _judge_ffma(m: GpuMeasurements) -> Finding:
    use = ENGINE_USE[FFMA]
    if m.ffma_flops_per_s is None:
        return Finding((m.index,), FFMA, None, f"{FFMA}: not measured; {use}")
    measured = f"{FFMA} {m.ffma_flops_per_s / 1e12:.1f} TFLOPS"
    if not m.read_bytes_per_s:
        return Finding((m.index,), FFMA, None, f"{measured} (memory read not measured); {use}")
    per_byte = m.ffma_flops_per_s / m.read_bytes_per_s
    throttled = per_byte < FFMA_HEALTHY_FLOPS_PER_BYTE / THROTTLE_MARGIN
    text = (
        f"{measured}, {per_byte:.0f} FLOP per byte read (healthy ≥ {FFMA_HEALTHY_FLOPS_PER_BYTE:g}, V100 17)"
        f" — {_status(throttled)}; {use}"
    )
    return Finding((m.index,), FFMA, throttled, text)


def _judge_read(m: GpuMeasurements) -> Finding:
    read = m.read_bytes_per_s
    if not read:
        return Finding((m.index,), MEMORY_READ, None, f"{MEMORY_READ}: not measured; {ENGINE_USE[MEMORY_READ]}")
    text = f"{MEMORY_READ} {_bandwidth(read)}"
    if m.copy_bytes_per_s:
        text += f" (device copy {_bandwidth(m.copy_bytes_per_s)}, read + write)"
    throttled = None
    known = [(card, figure) for card, figure in KNOWN_READ_BYTES_PER_S.items() if card in m.name]
    if known:
        card, figure = known[0]
        throttled = read < KNOWN_READ_SHORTFALL * figure
        if throttled:
            text += f", {read / figure:.0%} of a healthy {card}'s {_bandwidth(figure)} — throttled (lowered clocks?)"
        else:
            text += f", as expected (a healthy {card}: {_bandwidth(figure)})"
    limits = ", ".join(f"{name} ≤ {read / step:.0f} tok/s" for name, (_, step) in MODEL_BYTES.items())
    text += f"; {ENGINE_USE[MEMORY_READ]}, which caps Q8_0 decode at {limits}"
    return Finding((m.index,), MEMORY_READ, throttled, text)


def _judge_link(m: GpuMeasurements) -> Finding:
    to_gpu, from_gpu = m.host_to_device_bytes_per_s, m.device_to_host_bytes_per_s
    if not to_gpu or not from_gpu:
        return Finding((m.index,), HOST_LINK, None, f"{HOST_LINK}: not measured; {ENGINE_USE[HOST_LINK]}")
    link = max(to_gpu, from_gpu)
    throttled = link < HEALTHY_LINK_BYTES_PER_S / THROTTLE_MARGIN
    file_bytes, step_bytes = MODEL_BYTES["9B"]
    vector_seconds = HIDDEN_VECTOR_BYTES / min(to_gpu, from_gpu)
    # Pipelining moves one vector out and one in per GPU boundary and token: fine while that is a small part
    # of a decode step at the read limit.
    fine = not m.read_bytes_per_s or 2 * vector_seconds < 0.1 * step_bytes / m.read_bytes_per_s
    text = (
        f"{HOST_LINK} {_bandwidth(to_gpu)} to the GPU, {_bandwidth(from_gpu)} back: {_pcie_match(link)}"
        f" (healthy ≥ {_bandwidth(HEALTHY_LINK_BYTES_PER_S)}, Gen3 x4) — {_status(throttled)}: "
        f"loading 9B Q8_0 ({file_bytes / 1e9:.1f} GB) takes ~{_seconds(file_bytes / to_gpu)}; multi-GPU "
        f"pipelining sends one {HIDDEN_VECTOR_BYTES // 1024} KiB hidden vector per token (~{_seconds(vector_seconds)} "
        f"each way), {'fine' if fine else 'a noticeable part of a decode step'}"
    )
    return Finding((m.index,), HOST_LINK, throttled, text)


def _pcie_match(link_bytes_per_s: float) -> str:
    """The slowest common PCIe link at least as fast as a measured one; of links within 1% of each other (Gen3 x16
    and Gen4 x8), the wider, as GPUs sit in x16 slots."""
    links = [(lanes * lane, lanes, gen) for gen, lane in PCIE_LANE_BYTES_PER_S.items() for lanes in PCIE_WIDTHS]
    fast_enough = [link for link in links if link[0] >= link_bytes_per_s]
    if not fast_enough:
        return "faster than PCIe Gen5 x16"
    slowest = min(raw for raw, _, _ in fast_enough)
    raw, lanes, generation = max((link for link in fast_enough if link[0] <= 1.01 * slowest), key=lambda link: link[1])
    return f"looks like PCIe Gen{generation} x{lanes}, {_bandwidth(raw)} raw"


def _summary(index: int, findings: list[Finding]) -> Finding:
    throttled = [f.path for f in findings if f.throttled]
    if not throttled:
        return Finding((index,), "summary", False, "summary: nothing looks throttled")
    parts = "; ".join(f"{path} ({WHEN_THROTTLED[path]})" for path in throttled)
    return Finding((index,), "summary", True, f"summary: throttled — {parts}")


def _judge_peers(measurements: Sequence[GpuMeasurements]) -> list[Finding]:
    """P2P per pair of GPUs (possible when both directions are), or one finding when all pairs agree."""
    pairs: dict[tuple[int, int], bool] = {}
    for m in measurements:
        for peer, possible in m.peer_access.items():
            pair = (min(m.index, peer), max(m.index, peer))
            pairs[pair] = pairs.get(pair, True) and possible
    if not pairs:
        return [Finding((), P2P, None, "P2P: only one GPU")]
    without = "activations go through pinned host memory (what cmpchat does anyway)"
    with_p2p = "cmpchat does not need it (one hidden vector per token goes through pinned host memory)"
    if len(pairs) > 1 and len(set(pairs.values())) == 1:
        gpus = tuple(sorted({gpu for pair in pairs for gpu in pair}))
        names = ", ".join(map(str, gpus))
        if all(pairs.values()):
            return [Finding(gpus, P2P, None, f"P2P possible between every pair of GPUs {names}; {with_p2p}")]
        return [Finding(gpus, P2P, None, f"no P2P between any of GPUs {names}: {without}")]
    return [
        Finding(pair, P2P, None, f"P2P possible between GPU {a} and {b}; {with_p2p}")
        if possible
        else Finding(pair, P2P, None, f"no P2P between GPU {a} and {b}: {without}")
        for pair, possible in sorted(pairs.items())
        for a, b in [pair]
    ]


def _status(throttled: bool) -> str:
    return "throttled" if throttled else "not throttled"


def _times(ratio: float) -> str:
    """'3.4×' for ratios of at least 1, '1/40 of' below."""
    return f"{ratio:.1f}×" if ratio >= 1 else f"1/{1 / ratio:.0f} of"


def _bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.3g} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.3g} GB/s"


def _seconds(seconds: float) -> str:
    """Two significant digits, at most: 41 s, 180 ms, 37 µs, 0.15 µs."""
    unit, scale = next(((unit, scale) for unit, scale in (("s", 1), ("ms", 1e-3)) if seconds >= scale), ("µs", 1e-6))
    value = seconds / scale
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.2g} {unit}"
