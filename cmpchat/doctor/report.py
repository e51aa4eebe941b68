"""The doctor's output: a table of the figures (one column per GPU) and the verdict, or the same as JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict

from cmpchat.doctor.measurements import GpuMeasurements
from cmpchat.doctor.verdict import Finding, judge


def _rate(field: str, scale: float, unit: str, spec: str) -> Callable[[GpuMeasurements], str]:
    def cell(m: GpuMeasurements) -> str:
        value = getattr(m, field)
        return "-" if value is None else f"{value / scale:{spec}} {unit}"

    return cell


ROWS: list[tuple[str, Callable[[GpuMeasurements], str]]] = [
    ("device", lambda m: m.name),
    ("compute capability", lambda m: "sm_{}{}".format(*m.compute_capability)),
    ("SMs, memory", lambda m: f"{m.multiprocessors}, {m.memory_bytes / 2**30:.1f} GiB"),
    ("memory read", _rate("read_bytes_per_s", 1e9, "GB/s", ".0f")),
    ("device copy (r+w)", _rate("copy_bytes_per_s", 1e9, "GB/s", ".0f")),
    ("DP4A (8 ops each)", _rate("dp4a_ops_per_s", 1e12, "TOPS", ".1f")),
    ("FP16 FMA (HFMA2)", _rate("hfma2_flops_per_s", 1e12, "TFLOPS", ".1f")),
    ("FP32 FMA", _rate("ffma_flops_per_s", 1e12, "TFLOPS", ".1f")),
    ("tensor cores (wmma)", _rate("tensor_core_flops_per_s", 1e12, "TFLOPS", ".1f")),
    ("host → GPU (pinned)", _rate("host_to_device_bytes_per_s", 1e9, "GB/s", ".3g")),
    ("GPU → host (pinned)", _rate("device_to_host_bytes_per_s", 1e9, "GB/s", ".3g")),
]


def format_table(measurements: Sequence[GpuMeasurements]) -> str:
    rows = [("", *(f"GPU {m.index}" for m in measurements))]
    rows += [(label, *(cell(m) for m in measurements)) for label, cell in ROWS]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def format_findings(findings: Sequence[Finding]) -> str:
    """Each GPU's findings under its heading, then those about pairs of GPUs."""
    lines: list[str] = []
    heading = None
    for finding in findings:
        own = f"GPU {finding.gpus[0]}:" if len(finding.gpus) == 1 else "between GPUs:"
        if own != heading:
            lines += ["", own]
            heading = own
        lines.append(f"  - {finding.text}")
    return "\n".join(lines)


def format_report(measurements: Sequence[GpuMeasurements]) -> str:
    return format_table(measurements) + "\n" + format_findings(judge(measurements))


def json_report(measurements: Sequence[GpuMeasurements]) -> dict:
    """The figures (base units per second) and the findings, for scripts."""
    findings = [asdict(finding) | {"gpus": list(finding.gpus)} for finding in judge(measurements)]
    return {"gpus": [m.to_json() for m in measurements], "findings": findings}
