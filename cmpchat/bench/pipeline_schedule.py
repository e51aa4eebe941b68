"""How long a pipeline of stages on separate cards would take, from each stage's time measured alone: a
discrete-event replay of the order the CUDA backend issues work in, with each hop's copies over the cards' links.

On one GPU the stages of a pipeline contend for the same SMs and memory, so their sum, not their overlap, is
what a benchmark sees. What several cards would do is projected instead: each stage's step is timed alone (and
scaled to the CMP 100-210 as the single-card projections are), then replayed here on one timeline per card.

The order replayed is the backend's (`CudaBackend._prompt_steps`, `OverlappedHandOff`): prompt chunks in ticks,
stage k running chunk t - k at tick t, the stages of a tick in order. Each card has a compute stream and two copy
streams: a stage's step runs on the compute stream once the host has queued it and its input has arrived; its
output goes to host memory on its departure stream (device -> host over its own link); the host waits for those
bytes only when the next stage's turn comes in the tick, then queues their copy to the next card on that card's
arrival stream (host -> device over its link), where they land while the card still computes its previous
chunk. (With one copy stream a middle card's arrival would queue behind its departure, which waits for its
step: every chunk would pay both copies in turn.) A decode step of one group is sequential: a token goes through
every stage in turn, and between cards the chosen id comes back through the host. With one decode group a stage
in flight (`decode_pipeline.py`), the cards run different groups' steps at once; each card and each direction of
each link takes the groups' work in the order it comes (the host hands each step on as its bytes arrive).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CMP_LINK_BYTES_PER_SECOND = 250e6
"""PCIe Gen1 x1, each way (docs/hardware.md)."""
COPY_LATENCY_SECONDS = 20e-6
"""A copy's fixed cost: the driver call and the DMA's start (an assumption, of the order a small pinned copy
takes on any PCIe link; at 20 KB a hop it is a fifth of the transfer)."""


@dataclass(frozen=True)
class HostLink:
    """A card's PCIe link as one copy sees it."""

    bytes_per_second: float = CMP_LINK_BYTES_PER_SECOND
    latency: float = COPY_LATENCY_SECONDS

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bytes_per_second


@dataclass(frozen=True)
class PipelineTime:
    seconds: float
    busy: list[float]
    """Each stage's compute seconds over the run, as a share of it (its busy share)."""


def prefill_seconds(stage_seconds: Sequence[float], chunks: int, hop_bytes: int, link: HostLink) -> PipelineTime:
    """`chunks` prompt chunks through stages that take `stage_seconds` each per chunk, `hop_bytes` crossing each
    hop per chunk, replayed in the backend's order (module docstring)."""
    stages = len(stage_seconds)
    if stages < 1 or chunks < 0:
        raise ValueError("one time per stage, and a count of chunks")
    compute = [0.0] * stages  # when each card's compute stream has run everything queued on it
    arrivals = [0.0] * stages  # the same for its arrival stream
    departures = [0.0] * stages  # and its departure stream
    host = 0.0
    hop = link.seconds(hop_bytes)
    downloaded: dict[tuple[int, int], float] = {}  # (stage, chunk) -> its output is in host memory
    for tick in range(chunks + stages - 1):
        for k in range(stages):
            chunk = tick - k
            if not 0 <= chunk < chunks:
                continue
            arrived = host
            if k > 0:
                host = max(host, downloaded.pop((k - 1, chunk)))  # the host waits for the bytes
                arrivals[k] = arrived = max(arrivals[k], host) + hop
            compute[k] = max(compute[k], host, arrived) + stage_seconds[k]
            if k + 1 < stages:
                departures[k] = downloaded[k, chunk] = max(departures[k], compute[k]) + hop
    total = max(compute) if chunks else 0.0
    busy = [chunks * s / total if total else 0.0 for s in stage_seconds]
    return PipelineTime(total, busy)


def grouped_decode_seconds(
    stage_seconds: Sequence[float], groups: int, hop_bytes: int, link: HostLink, *, ids_bytes: int = 8, rounds: int = 40
) -> float:
    """Seconds a round takes in the steady state of `groups` decode groups in flight, each stepping once a round:
    a group's step runs on card k once its hidden states have come down card k - 1's link and up card k's, and
    its ids go down the last card's link and up the first's before its next step; every card and each direction
    of every link serves the groups in the order they come. The host is taken to keep up (it only hands on)."""
    stages = len(stage_seconds)
    if stages < 1 or groups < 1 or rounds < 2:
        raise ValueError("one time per stage, at least one group and two rounds")
    compute = [0.0] * stages  # when each card's compute stream is free
    down = [0.0] * stages  # and its link, device -> host
    up = [0.0] * stages  # and host -> device
    ready = [0.0] * groups  # when each group's next input is on the first card
    ends = []
    hop, ids = link.seconds(hop_bytes), link.seconds(ids_bytes)
    for _ in range(rounds):
        for group in range(groups):
            t = ready[group]
            for k, seconds in enumerate(stage_seconds):
                t = compute[k] = max(compute[k], t) + seconds
                if k + 1 < stages:
                    t = down[k] = max(down[k], t) + hop
                    t = up[k + 1] = max(up[k + 1], t) + hop
            if stages > 1:
                t = down[-1] = max(down[-1], t) + ids
                t = up[0] = max(up[0], t) + ids
            ready[group] = t
        ends.append(max(ready))
    half = rounds // 2
    return (ends[-1] - ends[half - 1]) / (rounds - half)


def decode_seconds(stage_seconds: Sequence[float], hop_bytes: int, link: HostLink, *, ids_bytes: int = 8) -> float:
    """One token through every stage in turn: each step, each hop's copies down and up, and, between cards, the
    chosen id down from the last card and up to the first."""
    stages = len(stage_seconds)
    hops = (stages - 1) * 2 * link.seconds(hop_bytes)
    ids = 2 * link.seconds(ids_bytes) if stages > 1 else 0.0
    return sum(stage_seconds) + hops + ids
