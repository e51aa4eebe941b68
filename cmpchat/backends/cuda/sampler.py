"""Token selection on the GPU for the CUDA backend: only B token ids come back to the host per step.

Per batch size, the selection kernels (`cmpchat.cuda.kernels.sampling`) are captured once as two graphs,
greedy (penalties + argmax) and sampled (the full filter chain and a Gumbel-max draw), over device
buffers that each step refreshes: packed parameters, the recent-token window for the penalties and a
Philox key. The key is drawn from the reply's own numpy generator every step, so a seeded reply is
reproducible; draws are exact in distribution but not the numbers numpy would draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.cuda.graph import LaunchGraph
from cmpchat.cuda.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.generation.sampling import SamplingParams

WINDOW = 64
"""Recent tokens kept on the device for the penalties; the default penalty window fits."""


@dataclass
class _Selection:
    params: Any
    rng: Any
    window: Any
    window_count: Any
    tokens: Any
    greedy: _LaunchList
    sampled: _LaunchList


class GpuSampler:
    def __init__(self, stream: Any, use_graphs: bool) -> None:
        self.stream = stream
        self.use_graphs = use_graphs
        self._by_batch: dict[int, _Selection] = {}

    def select(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
    ) -> list[int]:
        """Token ids for each row of `logits` (a device [B, V] array; edited in place by the penalties)."""
        batch = len(params)
        width = max([WINDOW, *(p.penalty_window for p in params if p.has_penalties)])
        selection = self._selection(logits, batch, width)
        window, count = window_from_histories(histories, width)
        keys = rng_state([int(rng.integers(0, 2**63)) for rng in rngs])
        stream = self.stream
        selection.params.copy_to_device(pack_params(params, width), stream=stream)
        selection.rng.copy_to_device(keys, stream=stream)
        selection.window.copy_to_device(window, stream=stream)
        selection.window_count.copy_to_device(count, stream=stream)
        graph = selection.greedy if all(p.is_greedy for p in params) else selection.sampled
        graph.replay(stream)
        tokens = selection.tokens.copy_to_host(stream=stream)
        stream.synchronize()
        return [int(t) for t in tokens]

    def _selection(self, logits: Any, batch: int, width: int) -> _Selection:
        selection = self._by_batch.get(batch)
        if selection is not None and selection.window.shape[1] == width:
            return selection
        vocab = int(logits.shape[1])
        workspace = SamplingWorkspace.allocate(batch, vocab)
        params = cuda.device_array((batch, 8), np.float64)
        rng = cuda.device_array((batch, 4), np.uint32)
        window = cuda.device_array((batch, width), np.int32)
        window_count = cuda.device_array(batch, np.int32)
        tokens = cuda.device_array(batch, np.int32)
        greedy = greedy_launches(logits, params, window, window_count, tokens, workspace)
        sampled = sampling_launches(logits, params, rng, window, window_count, tokens, workspace)
        selection = _Selection(
            params,
            rng,
            window,
            window_count,
            tokens,
            _LaunchList.capture(greedy, self.stream, self.use_graphs),
            _LaunchList.capture(sampled, self.stream, self.use_graphs),
        )
        self._by_batch[batch] = selection
        return selection


class _LaunchList:
    """Launches replayed as a captured graph, or one by one through Numba when graphs are off."""

    def __init__(self, launches: list[Any], graph: LaunchGraph | None) -> None:
        self.launches = launches
        self.graph = graph

    @classmethod
    def capture(cls, launches: list[Any], stream: Any, use_graphs: bool) -> _LaunchList:
        return cls(launches, LaunchGraph.capture(launches, stream) if use_graphs else None)

    def replay(self, stream: Any) -> None:
        if self.graph is not None:
            self.graph.replay(stream)
        else:
            for launch in self.launches:
                launch.run(stream)
