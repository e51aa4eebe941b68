"""Token selection on the GPU for the CUDA backend: only B token ids come back to the host per step.

Per batch size, the selection kernels (`cmpchat.kernels.sampling`) are captured once as two graphs,
greedy (penalties + argmax) and sampled (the full filter chain and a Gumbel-max draw), over device
buffers that each step refreshes: packed parameters, the recent-token window for the penalties and a
Philox key. A step with a grammar-constrained row uses a third or fourth graph (captured on first use) that
applies the allowed-token masks first; only the constrained rows' masks are uploaded (one copy a row, from
a pinned mirror), so unconstrained steps pay nothing. Likewise a step with a row that asks for log-probabilities
runs the `kernels.sampling_logprobs` kernels around the selection, and brings back B + 2 B x 20 numbers more. The key is drawn from the reply's own numpy generator every step, so a seeded reply is
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
from cmpchat.kernels.sampling_logprobs import MAX_TOP, LogprobWorkspace, chosen_logprob_launches, logprob_launches
from cmpchat.sampling import SamplingParams, TokenLogprobs, mask_words

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
            self.host[row, : mask.shape[0]] = mask
            self.host[row, mask.shape[0] :] = 0  # ids past a mask's end (LM-head padding) are not allowed
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
    """Where one selection's ids come back: a pinned host array and the event recorded after its copy; and, for
    selections that report log-probabilities, pinned arrays for them (made on first use)."""

    chosen: np.ndarray  # int32 [B] pinned
    arrived: Any
    owner: GpuChoice | None = None
    reports: _Reports | None = None


@dataclass
class _Reports:
    """Pinned host arrays for a selection's log-probabilities (as `LogprobWorkspace`'s results)."""

    logprob: np.ndarray  # float32 [B]: the chosen tokens'
    top_value: np.ndarray  # float32 [B, MAX_TOP]
    top_index: np.ndarray  # int32 [B, MAX_TOP]

    @classmethod
    def pinned(cls, batch: int) -> _Reports:
        return cls(
            cuda.pinned_array(batch, np.float32),
            cuda.pinned_array((batch, MAX_TOP), np.float32),
            cuda.pinned_array((batch, MAX_TOP), np.int32),
        )


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
    graphs: dict[tuple[bool, bool, bool], StepLaunches] = field(default_factory=dict)
    """The captured selections by (greedy, masked, reporting), made on first use: a step runs `apply_mask` only
    when a row has a grammar, the log-probability kernels only when a row asks for them."""
    masks: _MaskInputs | None = None
    reports: LogprobWorkspace | None = None
    packed_params: tuple[tuple[SamplingParams, ...], tuple[bool, ...], tuple[int | None, ...]] | None = None
    """The settings, mask flags and report sizes last packed into the staged parameters (they rarely change
    between steps)."""
    turn: int = 0

    def graph(self, greedy: bool, masked: bool, reporting: bool) -> StepLaunches:
        key = (greedy, masked, reporting)
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
            if reporting:  # the raw logits are read before the mask and the penalties edit them
                reports = self.report_workspace()
                launches = [
                    *logprob_launches(self.logits, params, reports),
                    *launches,
                    *chosen_logprob_launches(params, self.tokens, reports),
                ]
            self.graphs[key] = StepLaunches(launches, self.stream, self.use_graphs)
        return self.graphs[key]

    def report_workspace(self) -> LogprobWorkspace:
        if self.reports is None:
            ws = self.workspace
            self.reports = LogprobWorkspace.allocate(ws.batch, ws.vocab, ws.chunk)
        return self.reports

    def mask_inputs(self) -> _MaskInputs:
        if self.masks is None:
            self.masks = _MaskInputs(self.workspace.batch, mask_words(self.workspace.vocab))
        return self.masks

    @property
    def width(self) -> int:
        return int(self.inputs.views["window"].shape[1])

    def queue_fetch(self, stream: Any, reporting: bool) -> _Fetch:
        """Queue the copy of the chosen ids (and, `reporting`, of the log-probabilities) into the next host
        arrays of the ring, and its event. A choice still unread there gets its ids first (waiting for them), so
        none is lost."""
        fetch = self.fetches[self.turn]
        self.turn = (self.turn + 1) % len(self.fetches)
        if fetch.owner is not None:
            fetch.owner.tokens()
        _copy_down(fetch.chosen, self.tokens, stream)
        if reporting:
            workspace = self.report_workspace()
            host = fetch.reports = fetch.reports or _Reports.pinned(workspace.batch)
            _copy_down(host.logprob, workspace.chosen, stream)
            _copy_down(host.top_value, workspace.top_value, stream)
            _copy_down(host.top_index, workspace.top_index, stream)
        fetch.arrived.record(stream)
        return fetch


def _copy_down(host: np.ndarray, device: Any, stream: Any) -> None:
    """Queue the copy of a device array into the pinned host array of its size."""
    if SIMULATOR:  # runs in order at once; workspaces there are numpy arrays, device arrays read as them too
        host[...] = np.asarray(device)
        return
    pointers = (host.ctypes.data, device.device_ctypes_pointer.value)
    check("cuMemcpyDtoHAsync", driver.cuMemcpyDtoHAsync(*pointers, host.nbytes, stream_handle(stream)))


class GpuChoice(Selection):
    """Ids being chosen on the GPU: they lie in the step's token input until the next step's upload, and reach
    the host when `tokens()` has waited for them."""

    def __init__(self, fetch: _Fetch, reports: Sequence[int | None]) -> None:
        self._fetch = fetch
        self._ids: list[int] | None = None
        self._reports = list(reports)
        self._logprobs: list[TokenLogprobs | None] = [None] * len(reports)
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
            if any(top is not None for top in self._reports):
                self._logprobs = self._read_logprobs(fetch, self._ids)
            fetch.owner = None
        return self._ids

    def logprobs(self) -> list[TokenLogprobs | None]:
        self.tokens()
        return self._logprobs

    def _read_logprobs(self, fetch: _Fetch, ids: list[int]) -> list[TokenLogprobs | None]:
        host = fetch.reports
        assert host is not None, "a reporting selection's fetch has its report arrays"
        out: list[TokenLogprobs | None] = []
        for row, top in enumerate(self._reports):
            if top is None:
                out.append(None)
                continue
            best = zip(host.top_index[row, :top].tolist(), host.top_value[row, :top].tolist())
            out.append(TokenLogprobs(ids[row], float(host.logprob[row]), tuple(best)))
        return out


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
        logprobs: Sequence[int | None] | None = None,
    ) -> GpuChoice:
        """Queue the choice of a token for each row of `logits` (a device [B, V] array); returns at once. The
        penalties and masks edit the rows they read. `allowed` holds each row's packed allowed-token mask (None:
        any token); a step with a mask uploads the masked rows' masks and runs `apply_mask` first. `logprobs`
        holds how many most likely tokens each row reports with its chosen one's log-probability (None: no report;
        at most MAX_TOP); they come back with the ids."""
        batch = len(params)
        masks = list(allowed) if allowed is not None else [None] * batch
        masked = tuple(mask is not None for mask in masks)
        reports = tuple(logprobs) if logprobs is not None else (None,) * batch
        if any(top is not None and not 0 <= top <= MAX_TOP for top in reports):
            raise ValueError(f"a row may report at most {MAX_TOP} most likely tokens")
        reporting = any(top is not None for top in reports)
        width = self.history_window(params)
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
        settings = (tuple(params), masked, reports)
        if settings != selection.packed_params:
            staged["params"][:] = pack_params(params, width, masked, reports)
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
        selection.graph(greedy, any(masked), reporting).run(stream)
        return GpuChoice(selection.queue_fetch(stream, reporting), reports)

    @staticmethod
    def history_window(params: Sequence[SamplingParams]) -> int:
        """How many of each row's latest tokens a selection with `params` reads (for its penalties)."""
        return max([WINDOW, *(p.penalty_window for p in params if p.has_penalties)])

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
