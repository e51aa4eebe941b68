"""What `cmpchat doctor` measured on one GPU: plain numbers in base units per second, None when not measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuMeasurements:
    index: int
    name: str
    compute_capability: tuple[int, int]
    multiprocessors: int
    memory_bytes: int
    read_bytes_per_s: float | None = None
    """Streaming read with 16-byte loads over ≥ 1 GiB: the bandwidth that bounds decode."""
    copy_bytes_per_s: float | None = None
    """Device-to-device copy, counting read + write bytes."""
    dp4a_ops_per_s: float | None = None
    """8 ops per dp4a (4 multiplies + 4 adds)."""
    hfma2_flops_per_s: float | None = None
    """4 flops per HFMA2 (2 fp16 lanes × multiply + add)."""
    ffma_flops_per_s: float | None = None
    """2 flops per FP32 FMA."""
    tensor_core_flops_per_s: float | None = None
    """fp16 wmma m16n16k16 with fp32 accumulators, 2 flops per multiply-add; only with --tensor-cores."""
    host_to_device_bytes_per_s: float | None = None
    """From pinned host memory."""
    device_to_host_bytes_per_s: float | None = None
    """To pinned host memory."""
    peer_access: dict[int, bool] = field(default_factory=dict)
    """Other GPU index → whether this GPU can map its memory (P2P)."""

    def to_json(self) -> dict:
        record = asdict(self)
        record["compute_capability"] = list(self.compute_capability)
        record["peer_access"] = {str(peer): possible for peer, possible in self.peer_access.items()}
        return record
