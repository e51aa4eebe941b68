"""Kernel families of a decode or prompt step, and the bytes each family's launches read (for its bandwidth)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FAMILIES = ("GEMV", "GEMM", "attention", "GDN", "norm+quantize", "embedding", "other")

_PREFIXES = (
    ("gemv_", "GEMV"),
    ("gemm_", "GEMM"),
    ("attention_", "attention"),
    ("qk_norm_rope", "attention"),
    ("gdn_", "GDN"),
    ("rms_norm_quantize", "norm+quantize"),
    ("quantize_rows", "norm+quantize"),
    ("embed_", "embedding"),
)


def kernel_family(kernel_name: str) -> str:
    """The family a kernel belongs to, from its name (`gemv_q8_t1` -> GEMV)."""
    for prefix, family in _PREFIXES:
        if kernel_name.startswith(prefix):
            return family
    return "other"


@dataclass(frozen=True)
class FamilyTime:
    family: str
    launches: int
    seconds: float
    bytes_read: int
    """What the family must read per step (0 where it is not a bandwidth-bound family)."""
    in_replay: float | None = None
    """Seconds the family adds to a replay of the step (`profile.cost_in_replay`): less than `seconds` where
    its kernels overlap the others."""

    @property
    def bandwidth(self) -> float | None:
        return self.bytes_read / self.seconds if self.bytes_read and self.seconds > 0 else None


def family_times(
    names: Sequence[str],
    seconds: Sequence[float],
    family_bytes: dict[str, int],
    in_replay: dict[str, float] | None = None,
) -> list[FamilyTime]:
    """Sum per-launch times by family, in FAMILIES order; families without launches are left out."""
    totals: dict[str, list[float]] = {}
    for name, value in zip(names, seconds, strict=True):
        totals.setdefault(kernel_family(name), []).append(value)
    return [
        FamilyTime(
            family,
            len(totals[family]),
            sum(totals[family]),
            family_bytes.get(family, 0),
            None if in_replay is None else in_replay.get(family),
        )
        for family in FAMILIES
        if family in totals
    ]
