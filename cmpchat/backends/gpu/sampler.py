"""Token selection on the GPU for the CUDA backend: only B token ids come back to the host per step.

Per batch size, the selection kernels (`cmpchat.kernels.sampling`) are captured once as two graphs,
greedy (penalties + argmax) and sampled (the full filter chain and a Gumbel-max draw), over device
buffers that each step refreshes: packed parameters, the recent-token window for the penalties and a
Philox key. A step with a grammar-constrained row uses a third or fourth graph (captured on first use) that
applies the allowed-token masks first; only the constrained rows' masks are uploaded (one copy a row, from
a pinned mirror), so unconstrained steps pay nothing. The key is drawn from the reply's own numpy generator every step, so a seeded reply is
reproducible; draws are exact in distribution but not the numbers numpy would draw.

A step's inputs lie in one device allocation (params | rng | window_count | window, typed views at 64-byte
offsets) with a pinned host mirror, and one asynchronous copy sends the part the chosen graph reads: the
parameters when they changed, the Philox keys for sampled selection, the window only when a row has
penalties (the kernels only append to it otherwise). The ids come back through a pinned array: per step at
most one copy up, the graph, one copy down and an event, each a driver call that lets go of the GIL (which
a busy UI thread may then hold for a switch interval). The ids are written into the decode step's token
input too (`token_rows`), so the next step can consume them before they reach the host (`GpuChoice`, a
decode step fed `Chosen` inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.base import Selection
from cmpchat.backends.gpu.buffers import ordering_event
from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.graph import StepLaunches
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.kernels.sampling import (
    PARAM_COUNT,
    SamplingWorkspace,
    greedy_launches,
    mask_launches,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.sampling import SamplingParams, mask_words

if not SIMULATOR:
    from cuda.bindings import driver

WINDOW = 64
"""Recent tokens kept on the device for the penalties; the default penalty window fits."""

_ALIGN = 64
"""Byte alignment of each input's view in the packed buffer (the float64 parameters need 8)."""


class _PackedInputs:
    """Arrays of mixed dtypes as typed views of one uint8 device buffer with a pinned host mirror, laid out
    in the order given, so one copy uploads any leading run of them. Both start zeroed."""

    def __init__(self, layout: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
        spans, size = {}, 0
        for name, shape, dtype in layout:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            spans[name] = (size, size + nbytes)
            size += -(-nbytes // _ALIGN) * _ALIGN
        self.host = cuda.pinned_array(size, np.uint8)
        self.host[:] = 0
        self.device = cuda.to_device(self.host)
        self.end = {name: stop for name, (_, stop) in spans.items()}
        """Bytes to copy so that the inputs up to and including `name` arrive."""
        views = [(name, spans[name], shape, dtype) for name, shape, dtype in layout]
        self.staged = {name: self.host[a:b].view(dtype).reshape(shape) for name, (a, b), shape, dtype in views}
        """Host views to fill before `upload`."""
        self.views = {name: self.device[a:b].view(dtype).reshape(shape) for name, (a, b), shape, dtype in views}
        """Device views, for the kernels."""
        self._pointers = (0, 0) if SIMULATOR else (self.device.device_ctypes_pointer.value, self.host.ctypes.data)

    def upload(self, nbytes: int, stream: Any) -> None:
        """Queue the copy of the first `nbytes` of the mirror to the device (the mirror must then stay
        untouched until the stream has run the copy)."""
        if SIMULATOR:
            self.device[:nbytes].copy_to_device(self.host[:nbytes], stream=stream)
            return
        device, host = self._pointers
        check("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync(device, host, nbytes, stream_handle(stream)))


class _MaskInputs:
    """The allowed-token masks of one batch size: uint32 [B, words] on the device with a pinned host mirror.
    Only the rows of constrained selectors are written and uploaded, one copy each (31 KB a row at Qwen's
    vocabulary); the event is recorded after the last copy, so the mirror is rewritten only once it has run."""

    def __init__(self, batch: int, words: int) -> None:
        self.host = cuda.pinned_array((batch, words), np.uint32)
        self.host[:] = 0
        self.device = cuda.to_device(self.host)
        self.uploaded = ordering_event()
        self._row_bytes = words * 4
        self._pointers = (0, 0) if SIMULATOR else (self.device.device_ctypes_pointer.value, self.host.ctypes.data)

    def upload(self, masks: Sequence[np.ndarray | None], stream: Any) -> None:
        """Queue the copy of each given row's mask (rows with None keep whatever they hold: unread)."""
        self.uploaded.synchronize()
        for row, mask in enumerate(masks):
            if mask is None:
                continue
            self.host[row] = mask
            if SIMULATOR:
                self.device[row].copy_to_device(self.host[row], stream=stream)
            else:
                device, host = self._pointers
                offset = row * self._row_bytes
                result = driver.cuMemcpyHtoDAsync(
                    device + offset, host + offset, self._row_bytes, stream_handle(stream)
                )
                check("cuMemcpyHtoDAsync", result)
        self.uploaded.record(stream)


RING = 8
"""Selections of one batch size whose ids may be unread at once (the engine reads each one step later; decode
groups and prompts that finish add a few)."""


@dataclass
class _Fetch:
    """Where one selection's ids come back: a pinned host array and the event recorded after its copy."""

    chosen: np.ndarray  # int32 [B] pinned
    arrived: Any
    owner: GpuChoice | None = None


@dataclass
class _Selection:
    inputs: _PackedInputs
    uploaded: Any  # a CUDA event recorded after the last upload of `inputs`
    tokens: Any  # int32 [B] on the device, written by the kernels: the first B rows of the step's token input
    fetches: list[_Fetch]
    logits: Any
    workspace: SamplingWorkspace
    stream: Any
    use_graphs: bool
    graphs: dict[tuple[bool, bool], StepLaunches] = field(default_factory=dict)
    """The captured selections by (greedy, masked), made on first use: an unconstrained step never runs
    `apply_mask`, so it costs nothing when no row has a grammar."""
    masks: _MaskInputs | None = None
    packed_params: tuple[tuple[SamplingParams, ...], tuple[bool, ...]] | None = None
    """The settings and mask flags last packed into the staged parameters (they rarely change between steps)."""
    turn: int = 0

    def graph(self, greedy: bool, masked: bool) -> StepLaunches:
        key = (greedy, masked)
        if key not in self.graphs:
            views = self.inputs.views
            params, window, count = views["params"], views["window"], views["window_count"]
            if greedy:
                launches = greedy_launches(self.logits, params, window, count, self.tokens, self.workspace)
            else:
                launches = sampling_launches(
                    self.logits, params, views["rng"], window, count, self.tokens, self.workspace
                )
            if masked:
                launches = mask_launches(self.logits, params, self.mask_inputs().device, self.workspace) + launches
            self.graphs[key] = StepLaunches(launches, self.stream, self.use_graphs)
        return self.graphs[key]

    def mask_inputs(self) -> _MaskInputs:
        if self.masks is None:
            self.masks = _MaskInputs(self.workspace.batch, mask_words(self.workspace.vocab))
        return self.masks

    @property
    def width(self) -> int:
        return int(self.inputs.views["window"].shape[1])

    def queue_fetch(self, stream: Any) -> _Fetch:
        """Queue the copy of the chosen ids into the next host array of the ring, and its event. A choice still
        unread there gets its ids first (waiting for them), so none is lost."""
        fetch = self.fetches[self.turn]
        self.turn = (self.turn + 1) % len(self.fetches)
        if fetch.owner is not None:
            fetch.owner.tokens()
        if SIMULATOR:
            self.tokens.copy_to_host(fetch.chosen, stream=stream)
        else:
            host, device = fetch.chosen.ctypes.data, self.tokens.device_ctypes_pointer.value
            result = driver.cuMemcpyDtoHAsync(host, device, fetch.chosen.nbytes, stream_handle(stream))
            check("cuMemcpyDtoHAsync", result)
        fetch.arrived.record(stream)
        return fetch


class GpuChoice(Selection):
    """Ids being chosen on the GPU: they lie in the step's token input until the next step's upload, and reach
    the host when `tokens()` has waited for them."""

    def __init__(self, fetch: _Fetch) -> None:
        self._fetch = fetch
        self._ids: list[int] | None = None
        self.rows = len(fetch.chosen)
        fetch.owner = self

    @property
    def read(self) -> bool:
        """Whether `tokens()` has waited for the ids (so the selection's copies have run)."""
        return self._ids is not None

    def tokens(self) -> list[int]:
        if self._ids is None:
            fetch = self._fetch
            fetch.arrived.synchronize()
            self._ids = fetch.chosen.tolist()
            fetch.owner = None
        return self._ids


class GpuSampler:
    """Selects from `logits_rows[:B]` for B rows, a device buffer [rows, V]: the graphs are captured with its
    address. Give it the backend's step buffer, so a decode step's logits are read where they lie; logits
    from anywhere else (a prompt chunk's last row, the long-prompt step's own buffer) are copied there first.
    The chosen ids are written to `token_rows[:B]`, the step's token input (int32 [rows])."""

    def __init__(self, stream: Any, use_graphs: bool, logits_rows: Any, token_rows: Any) -> None:
        self.stream = stream
        self.use_graphs = use_graphs
        self.logits_rows = logits_rows
        self.token_rows = token_rows
        self._by_batch: dict[int, _Selection] = {}

    def select(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
        allowed: Sequence[np.ndarray | None] | None = None,
    ) -> GpuChoice:
        """Queue the choice of a token for each row of `logits` (a device [B, V] array); returns at once. The
        penalties and masks edit the rows they read. `allowed` holds each row's packed allowed-token mask (None:
        any token); a step with a mask uploads the masked rows' masks and runs `apply_mask` first."""
        batch = len(params)
        masks = list(allowed) if allowed is not None else [None] * batch
        masked = tuple(mask is not None for mask in masks)
        width = max([WINDOW, *(p.penalty_window for p in params if p.has_penalties)])
        rows = self.logits_rows[:batch]
        if _address(logits) != _address(rows):
            rows.copy_to_device(logits, stream=self.stream)
        selection = self._selection(rows, batch, width)
        # A key from every reply's generator every step, greedy rows too, so seeded replies stay reproducible.
        seeds = [int(rng.integers(0, 2**63)) for rng in rngs]
        greedy = all(p.is_greedy for p in params)
        inputs = selection.inputs
        staged = inputs.staged
        selection.uploaded.synchronize()  # the mirror's last copy has run (at once, in the engine's order)
        last = None
        settings = (tuple(params), masked)
        if settings != selection.packed_params:
            staged["params"][:] = pack_params(params, width, masked)
            selection.packed_params = settings
            last = "params"
        if not greedy:  # greedy_launches read no Philox key
            staged["rng"][:] = rng_state(seeds)
            last = "rng"
        if any(p.has_penalties for p in params):  # else no kernel reads the window, apply_penalties returns
            window, count = window_from_histories(histories, width)
            staged["window"][:] = window
            staged["window_count"][:] = count
            last = "window"
        stream = self.stream
        if last is not None:  # the device keeps the parameters of the last upload
            inputs.upload(inputs.end[last], stream)
            selection.uploaded.record(stream)
        if any(masked):
            selection.mask_inputs().upload(masks, stream)
        selection.graph(greedy, any(masked)).run(stream)
        return GpuChoice(selection.queue_fetch(stream))

    def _selection(self, logits: Any, batch: int, width: int) -> _Selection:
        selection = self._by_batch.get(batch)
        if selection is not None and selection.width == width:
            return selection
        vocab = int(logits.shape[1])
        workspace = SamplingWorkspace.allocate(batch, vocab)
        # In upload order: what every graph reads first, the window (penalties only) last.
        inputs = _PackedInputs(
            [
                ("params", (batch, PARAM_COUNT), np.float64),
                ("rng", (batch, 4), np.uint32),
                ("window_count", (batch,), np.int32),
                ("window", (batch, width), np.int32),
            ]
        )
        selection = _Selection(
            inputs,
            ordering_event(),
            self.token_rows[:batch],
            [_Fetch(cuda.pinned_array(batch, np.int32), ordering_event()) for _ in range(RING)],
            logits,
            workspace,
            self.stream,
            self.use_graphs,
        )
        self._by_batch[batch] = selection
        return selection


def _address(array: Any) -> int:
    """Where a device array's data starts (in the simulator, that of the host array standing in for it)."""
    return array.__array_interface__["data"][0] if SIMULATOR else array.device_ctypes_pointer.value
