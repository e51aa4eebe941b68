"""The few CUDA driver calls behind raw launches and graphs, through cuda-bindings' `driver` module.

cuda-bindings mirrors the C driver API, whose calls used here read the same in its 12.x (CMP users) and
13.x (the H200 test machine) releases; cuda.core's Python API moved between its 0.x and 1.x releases, so the
launch path leans on the driver API and leaves cuda.core to Numba.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver

SUCCESS = driver.CUresult.CUDA_SUCCESS


class CudaDriverError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error name."""


def check(call: str, result: tuple[Any, ...]) -> Any:
    """Raise on a failed cuda-bindings call; return its single result, a tuple of several, or None."""
    error = result[0]
    if error != SUCCESS:
        name = driver.cuGetErrorName(error)[1]
        raise CudaDriverError(f"{call} failed: {name.decode() if isinstance(name, bytes) else error}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def stream_handle(stream: Any) -> int:
    """The raw `CUstream` value of a stream given as a Numba stream, a cuda.core stream (anything with
    `__cuda_stream__`), a PyTorch stream (`cuda_stream`), a cuda-bindings `CUstream`, or an int (0 is
    the legacy default stream)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    torch_handle = getattr(stream, "cuda_stream", None)
    if torch_handle is not None:
        return int(torch_handle)
    return int(stream)
