"""Per-step integers (position, sequence length, token id…) kept in device memory.

A graph captures kernel parameters by value, so anything that changes from one decode step to the next
cannot be a scalar parameter. Kernels take it as a one-element device array instead and read `value[0]`;
the graph then reads whatever that memory holds when it is replayed. `DeviceScalars` keeps such values
together: one device array, one pinned host mirror, one copy per step:

    scalars = DeviceScalars(("position", "length"))
    launches = [rope(..., position=scalars["position"]), attention(..., length=scalars["length"])]
    graph = LaunchGraph.capture(launches, stream)
    for step in ...:
        scalars.set(position=p, length=p + 1)
        scalars.upload(stream)   # ordered before the replay on the same stream
        graph.replay(stream)

Values a kernel computes (the sampled token, say) can stay on the device: a kernel writes the slot that the
next step's kernels read, and the host uploads nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.intrinsics import SIMULATOR

if not SIMULATOR:
    from cuda.bindings import driver


class DeviceScalars:
    """Named values of one dtype in device memory, each passed to kernels as a one-element array."""

    def __init__(self, names: Sequence[str], dtype: np.dtype | type = np.int32) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"need distinct names, got {list(names)}")
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.host = cuda.pinned_array(len(self.names), dtype)
        self.host[:] = 0
        self.device = cuda.to_device(self.host)
        self._views = {name: self.device[i : i + 1] for name, i in self._index.items()}

    def __getitem__(self, name: str) -> Any:
        """The one-element device array a kernel reads this value from (a fixed address)."""
        return self._views[name]

    def set(self, **values: int | float) -> None:
        """Stage new values in the pinned host mirror; `upload` sends them.

        The previous upload must have run first (the engine waits for each step's result, so it has).
        """
        for name, value in values.items():
            self.host[self._index[name]] = value

    def get(self, name: str) -> int | float:
        """The staged host value (not read back from the device)."""
        return self.host[self._index[name]].item()

    def upload(self, stream: Any = 0) -> None:
        """Copy the staged values to the device, ordered on `stream` before work queued after it."""
        if SIMULATOR:
            self.device.copy_to_device(self.host, stream=stream)
            return
        pointer = self.device.__cuda_array_interface__["data"][0]
        result = driver.cuMemcpyHtoDAsync(pointer, self.host.ctypes.data, self.host.nbytes, stream_handle(stream))
        check("cuMemcpyHtoDAsync", result)
